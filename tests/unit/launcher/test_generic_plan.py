"""The generic transformers path at plan time: which checkpoints take it, the line that says so (and the
native families' line), and the settings it does not have refused by their keys before anything starts.
Also: the launcher reads transformers' facts from its source files without importing torch."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from launcher.launch import launch, prepare
from launcher.model_path import explicit_model_keys, resolve_model_path
from launcher.plan import PlanError, build_plan
from tests.conftest import REPO, compose
from tests.models.hf_dirs import generic_dir, llama_dir
from workers.models.hf_dir import CheckpointError, model_fields
from workers.models.tiny_moe.spec import NOT_HF


@pytest.fixture(scope="module")
def phi(tmp_path_factory):
    return generic_dir(tmp_path_factory.mktemp("phi") / "tiny-phi", "phi", tokenizer_vocab=100)


def resolved(directory, *overrides):
    overrides = [f"model.path={directory}", *overrides]
    return resolve_model_path(compose(overrides), explicit_model_keys(overrides))


def test_an_architecture_no_family_covers_takes_the_generic_path(phi):
    cfg = resolved(phi)
    m = cfg.model
    assert (m.family, m.architecture, m.model_type) == ("hf_generic", "PhiForCausalLM", "phi")
    assert (m.vocab_size, m.hidden_size, m.num_layers, m.num_heads, m.max_position_embeddings) == (128, 32, 2, 4, 128)
    plan = prepare(cfg).plan  # the tensor check (a child process with torch) passes too
    route = [ln for ln in plan.summary() if ln.startswith("model path: generic")]
    assert route == [f"model path: generic transformers path (architectures=['PhiForCausalLM'] has no native family; "
                     f"transformers {__import__('transformers').__version__} builds it); data parallel only (no "
                     f"TP/EP/CP, no Router Replay); embedded engine: dynamic KV cache, no CUDA graphs"]
    assert plan.num_params == 25344  # summed from the safetensors header: every tensor of the checkpoint


def test_native_families_say_so(tmp_path):
    cfg = resolved(llama_dir(tmp_path / "llama"))
    assert "model path: native family llama" in build_plan(cfg).summary()
    default = [ln for ln in build_plan(compose([])).summary() if ln.startswith("model path:")]
    assert default == [f"model path: {NOT_HF}"]  # issue 47 item 12: the default model's steps are not HF dirs


def test_the_default_models_plan_says_its_steps_are_not_hugging_face_directories(tmp_path, capsys):
    """What a user of the default model (a bring-your-own dataset run, say) reads before it starts,
    local and Slurm alike; a tiny_dense run (LlamaForCausalLM steps) does not read it."""
    assert launch(compose([f"cluster.runs_root={tmp_path}", "launcher.dry_run=true"])) == 0
    out = capsys.readouterr().out
    assert "published steps are NOT Hugging Face directories" in out and "model.path=DIR" in out
    slurm = build_plan(compose(["cluster=local_slurm"])).summary()
    assert any("published steps are NOT Hugging Face directories" in ln for ln in slurm)
    assert launch(compose([f"cluster.runs_root={tmp_path}", "launcher.dry_run=true", "model=tiny_dense"])) == 0
    assert "NOT Hugging Face" not in capsys.readouterr().out


@pytest.mark.parametrize("override, message", [
    ("trainer.parallel.tp=2", r"trainer.parallel.tp=2: PhiForCausalLM takes the generic transformers path, which "
                              r"trains data parallel only .*; set trainer.parallel.tp=1"),
    ("trainer.parallel.cp=2", r"trainer.parallel.cp=2: .*data parallel only"),
    ("inference.static_cache=on", r"inference.static_cache=on: PhiForCausalLM takes the generic transformers path.*"
                                  r"inference.static_cache=auto .*inference=sglang_node"),
    ("trainer.router_replay=true", r"trainer.router_replay=true needs a MoE model"),
])
def test_what_the_generic_path_lacks_is_refused_by_its_key(phi, override, message):
    with pytest.raises(PlanError, match=message):
        build_plan(resolved(phi, "trainer.num_ranks=2", override))


def test_unknown_model_types_keep_the_clear_refusal(phi, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(phi, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "model_type": "my_own_lm", "architectures": ["MyLM"]}))
    with pytest.raises(CheckpointError, match=r"architectures=\['MyLM'\] is not supported; supported architectures: "
                                              r"\[.*'LlamaForCausalLM'.*\]; model_type='my_own_lm' is not one "
                                              r"transformers .*AutoModelForCausalLM builds"):
        model_fields(d)
    (d / "config.json").write_text(json.dumps({**config, "architectures": ["PhiForSequenceClassification"]}))
    with pytest.raises(CheckpointError, match=r"transformers builds 'PhiForCausalLM' for model_type='phi', not "
                                              r"'PhiForSequenceClassification'"):
        model_fields(d)
    (d / "config.json").write_text(json.dumps({**config, "max_position_embeddings": None}))
    with pytest.raises(PlanError, match=r"model.max_position_embeddings must be > 0, got 0"):  # none in config.json
        build_plan(resolved(d))
    assert build_plan(resolved(d, "model.max_position_embeddings=64")).model  # set explicitly: planned


def test_the_launcher_reads_transformers_without_torch(phi):
    code = ("import sys; from workers.models.hf_dir import model_fields; "
            f"spec, fields = model_fields({str(phi)!r}); "
            "assert spec.name == 'hf_generic' and fields['num_layers'] == 2; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
