"""``slurmrl model.path=DIR`` for an architecture no native family covers (GPT-2: learned positions,
a tied head, transformers' names under ``transformer.h``): the plan names the generic transformers
path, two FSDP trainer ranks train transformers' own layers, the embedded engine generates with
them (its start-up check against transformers' forward logged), and every published step is a
directory ``from_pretrained`` loads with no missing key, computing the trainer's function."""
from __future__ import annotations

import json

import torch
import transformers
from safetensors.torch import load_file

from tests.integration.conftest import SMALL, assert_no_children_left, metrics, slurmrl
from tests.models.hf_dirs import generic_dir
from workers.common.config.run import load_run_config
from workers.weights.filesystem.receiver import DiskReader


def test_a_gpt2_checkpoint_trains_through_the_generic_path(tmp_path):
    source = generic_dir(tmp_path / "tiny-gpt2", "gpt2", tokenizer_vocab=100)
    run_dir = tmp_path / "run"
    proc = slurmrl([*SMALL, f"model.path={source}", "env=reverse_text", "orchestrator.max_off_policy_steps=0",
                    "trainer.num_steps=3", "trainer.num_ranks=2", "weights.keep_last=10",
                    f"launcher.run_dir={run_dir}"], tmp_path)
    assert ("model path: generic transformers path (architectures=['GPT2LMHeadModel'] has no native family"
            in proc.stdout), proc.stdout
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(r["mismatch_kl"] < 1e-6 for r in recs), recs  # engine and trainer: the same function
    assert any(r["grad_norm"] > 0 for r in recs), recs  # reverse_text's similarity reward varies: it trains
    cfg = load_run_config(str(run_dir / "config" / "run.yaml"))
    assert (cfg.model.family, cfg.model.architecture, cfg.model.path) == ("hf_generic", "GPT2LMHeadModel", str(source))
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("inference_*.log"))
    assert "logits agree with transformers' own forward" in logs
    weights = run_dir / "weights"
    step0 = DiskReader().load(weights / "step_000000").state  # the checkpoint, streamed in and published unchanged
    reference = load_file(str(source / "model.safetensors"))
    assert set(step0) == set(reference) and all(torch.equal(step0[k], reference[k]) for k in reference)
    last = weights / "step_000003"
    published = DiskReader().load(last).state
    assert any(not torch.equal(published[k], reference[k]) for k in reference)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(last, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert torch.equal(hf.state_dict()["transformer.h.1.mlp.c_fc.weight"], published["transformer.h.1.mlp.c_fc.weight"])
    assert hf.lm_head.weight is hf.transformer.wte.weight  # still tied
    assert json.loads((last / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    assert len(transformers.AutoTokenizer.from_pretrained(last)) == 100
    assert_no_children_left(run_dir)
