"""model.path at plan time (launcher/model_path.py): the family and fields come from config.json,
explicit overrides that contradict it and every bad directory are refused before anything is
written, and ``slurmrl model.path=DIR launcher.dry_run=true`` resolves the model section."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from launcher.launch import prepare
from launcher.model_path import check_model_path, explicit_model_keys, resolve_model_path
from launcher.plan import PlanError
from tests.conftest import REPO, compose
from tests.models.hf_dirs import llama_dir
from workers.common.config.run import load_run_config
from workers.models.llama.config import LlamaConfig


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return llama_dir(tmp_path_factory.mktemp("llama") / "my-llama", tokenizer_vocab=100)


def resolved(hf, *overrides):
    overrides = [f"model.path={hf}", *overrides]
    return resolve_model_path(compose(overrides), explicit_model_keys(overrides))


def test_explicit_keys_are_read_from_the_command_line():
    assert explicit_model_keys(["model.path=/x", "+model.init_seed=3", "++model.name=a", "model=tiny_dense",
                                "trainer.lr=1", "modelx=1"]) == {"path", "init_seed", "name", "model"}


def test_the_family_and_fields_come_from_config_json(hf):
    cfg = resolved(hf, "model.init_seed=7")
    m = cfg.model
    assert isinstance(m, LlamaConfig) and m.family == "llama" and m.name == "my-llama" and m.path == str(hf)
    assert (m.num_layers, m.hidden_size, m.num_kv_heads, m.dense_intermediate_size, m.vocab_size) == (2, 32, 2, 64, 128)
    assert m.init_seed == 7  # explicit, not in config.json: kept
    assert resolved(hf, "model.num_layers=2").model.num_layers == 2  # agreeing with config.json is fine
    prepare(cfg)  # plans, and the directory checks pass


@pytest.mark.parametrize("override, message", [
    ("model.num_layers=3", r"model.num_layers=3 contradicts .*my-llama/config.json, which says 2"),
    ("model.family=tiny_moe", r"model.family=tiny_moe contradicts .*config.json \(family llama\)"),
    ("model=tiny_dense", r"model.path=.* takes the family and architecture from its config.json; drop the "
                         r"model=<preset> choice"),
    ("model.num_experts=4", r"model.num_experts is not a field of family llama"),
])
def test_contradicting_overrides_are_refused(hf, override, message):
    with pytest.raises(PlanError, match=message):
        resolved(hf, override)


def test_bad_directories_are_refused_before_anything_is_written(hf, tmp_path):
    with pytest.raises(PlanError, match="is not a directory"):
        resolved(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PlanError, match=r"empty/config.json: no config.json"):
        resolved(tmp_path / "empty")
    cfg = resolved(hf)
    cfg.model.vocab_size = 64  # a stale run.yaml, or a config built in Python
    with pytest.raises(PlanError, match=r"model.vocab_size=64 contradicts .*config.json \(128\)"):
        check_model_path(cfg)


def test_pretrained_dir_alone_and_two_sources_are_refused(hf):
    with pytest.raises(PlanError, match=r"model.pretrained_dir=/somewhere is set but model.pretrained is empty.*"
                                        r"use model.path=/somewhere"):
        prepare(compose(["model=tiny_dense", "model.pretrained_dir=/somewhere"]))
    cfg = resolved(hf)
    cfg.model.pretrained = "smollm2_135m"
    with pytest.raises(PlanError, match=r"model.pretrained=smollm2_135m and model.path=.* both name the starting "
                                        r"weights"):
        prepare(cfg)


def cli(tmp_path, *args):
    cmd = [sys.executable, "-m", "launcher", f"cluster.runs_root={tmp_path / 'runs'}", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_cli_dry_run_resolves_the_model_section(hf, tmp_path):
    run_dir = tmp_path / "run"
    out = cli(tmp_path, f"model.path={hf}", "launcher.dry_run=true", f"launcher.run_dir={run_dir}")
    assert out.returncode == 0, out.stderr[-2000:]
    cfg = load_run_config(str(run_dir / "config" / "run.yaml"))
    assert cfg.model.family == "llama" and cfg.model.num_layers == 2 and cfg.model.path == str(hf)
    plan = json.loads((run_dir / "config" / "plan.json").read_text())
    assert plan["params"]["total"] == sum([128 * 32 * 2, 2 * (2 * 32 * 32 + 2 * 16 * 32 + 3 * 32 * 64 + 2 * 32), 32])  # q,o + k,v + mlp + norms
    bad = cli(tmp_path, f"model.path={hf}", "model.hidden_size=64", "launcher.dry_run=true")
    assert bad.returncode == 2 and "model.hidden_size=64 contradicts" in bad.stderr, bad.stderr[-2000:]


def test_cli_refuses_a_checkpoint_missing_a_tensor_before_writing_anything(hf, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(hf, bad)
    state = load_file(str(bad / "model.safetensors"))
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, str(bad / "model.safetensors"))
    out = cli(tmp_path, f"model.path={bad}")  # not a dry run: the tensor check runs before the run dir exists
    assert out.returncode == 2, out.stderr[-2000:]
    assert "bad: tensors missing from the checkpoint (1): ['model.layers.1.self_attn.k_proj.weight']" in out.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_chat_env_takes_the_tokenizer_and_template_from_model_path(hf, tmp_path):
    from workers.orchestrator.envs.reverse_text import ReverseTextEnv

    cfg = resolved(hf, "env=reverse_text", "env.max_new_tokens=8")
    prepare(cfg)  # the env's tokenizer check finds hf's tokenizer.json
    env = ReverseTextEnv(cfg.env, seed=0, model=cfg.model)
    task = env.sample_task()
    assert all(0 <= i < 100 for i in task.prompt_ids) and env.stop_token_ids == (0,)  # <eos> is id 0
    bare = tmp_path / "bare"
    shutil.copytree(hf, bare, ignore=shutil.ignore_patterns("tokenizer*", "chat_template*"))
    with pytest.raises(PlanError, match=r"env=reverse_text uses a pretrained model's tokenizer .* model.path has no "
                                        r"tokenizer"):
        prepare(resolved(bare, "env=reverse_text", "env.max_new_tokens=8"))


def test_resolving_and_checking_model_path_imports_no_torch(hf):
    script = f"""
import sys
from tests.conftest import compose
from launcher.launch import prepare
from launcher.model_path import explicit_model_keys, resolve_model_path
overrides = ["model.path={hf}"]
prepare(resolve_model_path(compose(overrides), explicit_model_keys(overrides)))
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "safetensors"))
assert not heavy, heavy
"""
    res = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
