"""``slurmrl model.path=DIR``: a local run starts from a Hugging Face checkpoint made by
transformers (tiny Llama + a BPE tokenizer trained offline), and a published step loads in
``AutoModelForCausalLM.from_pretrained`` with no missing keys and computes the trainer's function."""
from __future__ import annotations

import json

import torch
import transformers  # the reference every model test imports; `make test` installs it
from safetensors.torch import load_file

from tests.integration.conftest import SMALL, assert_no_children_left, metrics, slurmrl
from tests.models.hf_dirs import llama_dir
from workers.common.config.run import load_run_config
from workers.models.tiny_moe.model import TinyMoeForCausalLM
from workers.weights.filesystem.receiver import DiskReader


def test_a_run_starts_from_model_path_and_publishes_transformers_directories(tmp_path):
    source = llama_dir(tmp_path / "tiny-llama", tokenizer_vocab=100)
    run_dir = tmp_path / "run"
    slurmrl([*SMALL, f"model.path={source}", "orchestrator.max_off_policy_steps=0", "trainer.num_steps=3",
             "weights.keep_last=10", f"launcher.run_dir={run_dir}"], tmp_path)
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3]
    cfg = load_run_config(str(run_dir / "config" / "run.yaml"))
    assert (cfg.model.family, cfg.model.name, cfg.model.path) == ("llama", "tiny-llama", str(source))
    weights = run_dir / "weights"
    # Step 0 is the checkpoint itself, streamed in by the trainer and published unchanged.
    step0 = DiskReader().load(weights / "step_000000").state
    reference = load_file(str(source / "model.safetensors"))
    assert set(step0) == set(reference) and all(torch.equal(step0[k], reference[k]) for k in reference)
    last = weights / "step_000003"
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(last, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ours = TinyMoeForCausalLM(cfg.model)
    published = DiskReader().load(last).state
    ours.load_state_dict(published, strict=True)
    # A random tiny Llama rarely emits a digit, so a 3-step run may see no reward at all (zero
    # advantages, zero gradient): the published weights must change exactly when a gradient did.
    trained = any(r["grad_norm"] > 0 for r in metrics(run_dir))
    assert any(not torch.equal(published[k], reference[k]) for k in reference) == trained
    ids = torch.tensor([[5, 3, 9, 1, 2, 14, 7, 7]])
    with torch.no_grad():
        a, b = hf.eval()(input_ids=ids).logits, ours.eval()(ids).logits
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    assert json.loads((last / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert len(transformers.AutoTokenizer.from_pretrained(last)) == 100  # the source's tokenizer came along
    assert_no_children_left(run_dir)
