"""The issue-36 benchmarks run at toy sizes on CPU and write the columns the GPU session reads:
model_parity's real-shape rows (ours through the fused head, MFU) and the log-prob head table."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def run(args: list[str]) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]


def test_model_parity_real_shape_row(tmp_path):
    out = tmp_path / "mp.json"
    run(["benchmarks.model_parity", "--size", "real", "--toy", "--families", "qwen3_moe", "--compile", "off",
         "--iters", "1", "--batch", "2", "--seq", "16", "--out", str(out)])
    row = json.loads(out.read_text())["rows"][0]
    assert row["shape"] == "real" and row["ours_head"] == "fused_loss" and row["adamw"] == "foreach" and row["top_k"] == 4
    assert row["train_flops_per_step"] > 6 * 32 and 0 < row["mfu_ours"] < 1 and row["ratio_ours_over_hf"] > 0


def test_logprob_head_table(tmp_path):
    run(["benchmarks.gpu.bench_logprob_head", "--smoke", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "logprob_head.json").read_text())
    assert {r["way"] for r in result["rows"]} == {"fused", "checkpoint", "full"}
    assert result["fused_speedup_over_checkpoint"]["1000"] > 0


def test_real_step_rows_per_head(tmp_path):
    """bench_real_step times every --heads value on the same model: one row each, the head named; with
    --micro-batch-tokens the optimizer step accumulates over micro-batches, and the step's split is there."""
    run(["benchmarks.gpu.bench_real_step", "--smoke", "--families", "qwen3_moe", "--heads", "fused,fused_loss",
         "--micro-batch-tokens", "32,64", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "real_step.json").read_text())["rows"]
    assert [(r["logprob_head"], r["micro_batch_tokens"]) for r in rows] == [
        ("fused", 32), ("fused", 64), ("fused_loss", 32), ("fused_loss", 64)]
    assert all(r["step_s"] > 0 and r["top_k"] == 4 for r in rows)
    for r in rows:  # smoke: 2 rows x 32 tokens, 32 (or 64) tokens per micro-batch
        assert r["tokens_per_optimizer_step"] == 64 and r["micro_batches"] == 64 // r["micro_batch_tokens"]
        split = r["split"]
        assert set(split) == {"forward_backward", "grad_sync_clip", "optimizer", "bookkeeping", "master_cast_est"}
        assert split["forward_backward"] > 0 and split["optimizer"] > 0 and split["bookkeeping"] >= -1e-3
        assert split["forward_backward"] + split["optimizer"] < 2 * r["step_s"] + 1.0


def test_profile_splits_the_step_through_the_trainers_head(tmp_path):
    """profile_model_parity times ours through --ours-head (the trainer's default) and transformers,
    phase by phase, and lists the kernels of one profiled step of each."""
    run(["benchmarks.gpu.profile_model_parity", "--toy", "--device", "cpu", "--backend", "eager", "--iters", "1",
         "--top", "3", "--families", "qwen3_moe", "--batch", "1", "--seq", "16", "--out", str(tmp_path)])
    row = json.loads((tmp_path / "profile_model_parity.json").read_text())["rows"][0]
    assert row["ours_head"] == "fused_loss"
    for side in ("ours_compiled", "hf_compiled"):
        assert 0 < row[side]["forward_s"] < row[side]["step_s"] and len(row[side]["kernels"]) == 3
    assert set(row["head_only"]) == {"ours_fused_s", "ours_fused_loss_s", "logits_ce_s"}
