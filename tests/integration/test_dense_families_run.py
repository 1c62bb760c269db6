"""``slurmrl model.path=DIR`` on each new dense family (qwen3, qwen2, mistral): a tiny checkpoint written
by transformers itself is read through config.json (the family chosen by ``architectures``), the
embedded engine generates with it, the trainer trains it under the FSDP plan, and the published step
loads in ``AutoModelForCausalLM.from_pretrained`` with no missing keys and computes the trainer's
function. mistral's window (8) is smaller than the rollouts, so the window is in every path."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from tests.integration.conftest import SMALL, assert_no_children_left, metrics, slurmrl
from tests.models.hf_dirs import hf_dir
from workers.common.config.run import load_run_config
from workers.models.dense.model import DenseForCausalLM
from workers.weights.filesystem.receiver import DiskReader

FAMILIES = {  # family -> (architecture, model_type, what the tiny checkpoint sets beyond TINY_DENSE)
    "qwen3": ("Qwen3ForCausalLM", "qwen3", dict(head_dim=16, tie_word_embeddings=True)),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", dict(use_sliding_window=False, sliding_window=4096, max_window_layers=1)),
    "mistral": ("MistralForCausalLM", "mistral", dict(sliding_window=8, head_dim=16)),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_dense_family_runs_from_model_path(tmp_path, family):
    arch, model_type, overrides = FAMILIES[family]
    source = hf_dir(tmp_path / f"tiny-{family}", arch, model_type, tokenizer_vocab=100, **overrides)
    run_dir = tmp_path / "run"
    slurmrl([*SMALL, f"model.path={source}", "orchestrator.max_off_policy_steps=0", "trainer.num_steps=1",
             f"launcher.run_dir={run_dir}"], tmp_path)
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == [1]
    assert recs[0]["mismatch_kl"] < 1e-3, recs[0]["mismatch_kl"]  # engine and trainer: the same function
    cfg = load_run_config(str(run_dir / "config" / "run.yaml"))
    assert cfg.model.family == family and cfg.model.sliding_window == overrides.get("sliding_window", 0) * (
        family == "mistral")
    last = run_dir / "weights" / "step_000001"
    assert json.loads((last / "config.json").read_text())["architectures"] == [arch]
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(last, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ours = DenseForCausalLM(cfg.model)
    ours.load_state_dict(DiskReader().load(last).state, strict=True)
    ids = torch.tensor([[5, 3, 9, 1, 2, 14, 7, 7, 3, 8, 1, 4]])  # 12 tokens: past mistral's window of 8
    with torch.no_grad():
        a, b = hf.eval()(input_ids=ids).logits, ours.eval()(ids).logits
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    assert_no_children_left(run_dir)
