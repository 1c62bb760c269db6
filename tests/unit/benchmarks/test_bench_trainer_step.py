"""The GPU benchmark of the real trainer step (benchmarks/gpu/bench_trainer_step.py) runs its ``--tiny``
path on CPU: a typo or an API drift in the trainer must fail here, not on rented GPU time.

Each run is a subprocess: the benchmark opens a process group of world 1, which must not meet
one that another test of this session left behind.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs the benchmark itself, torch.compile included

REPO = Path(__file__).resolve().parents[3]


def run_bench(out: Path, *extra: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-m", "benchmarks.gpu.bench_trainer_step", "--tiny", "--out", str(out), *extra],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads((out / "trainer_step.json").read_text())


def test_tiny_rows_real_and_direct(tmp_path):
    res = run_bench(tmp_path)
    runs = res["runs"]
    rows = [(r["kind"], r["router_replay"], r["activation_checkpointing"]) for r in runs]
    assert rows == [("real", False, "none"), ("real", True, "none"), ("real", False, "full"),
                    ("direct", False, "none")]
    for r in runs:
        assert r["tokens_per_s"] > 0 and r["mfu"] > 0, r
        assert r["tokens_per_step"] == 2 * 64
    for r in runs[:-1]:
        assert r["plan"] == "fsdp"  # the trainer's plan at tp = ep = 1
        assert r["master_dtype"] == "float32" and r["dtype"] == "bfloat16"
        assert r["weights_changed_frac"] > 0.5, r  # AdamW stepped the fp32 master weights
        assert r["ratio_vs_direct"] > 0
        stats = r["last_step_stats"]
        assert stats["num_loss_tokens"] == 2 * (64 - 64 // 8)
        assert 0.9 < stats["ratio_mean"] < 1.1  # inference log-probs are the model's own
    # Replay forced the batch's (random) experts: the balance loss counts them, not the router's picks.
    assert runs[0]["last_step_stats"]["aux_loss"] != runs[1]["last_step_stats"]["aux_loss"]


def test_tiny_micro_batches(tmp_path):
    res = run_bench(tmp_path, "--micro-batch-tokens", "64", "--extra-ac", "", "--skip-direct", "--iters", "1")
    assert [r["micro_batch_tokens"] for r in res["runs"]] == [64, 64]
    assert all(r["tokens_per_s"] > 0 and r["weights_changed_frac"] > 0.5 for r in res["runs"])


def test_tiny_compiled_rows(tmp_path):
    """trainer.compile=layers rows (replay off and on) through the real step, aot_eager on CPU: the
    same loss as the eager rows (the first step is the same weights and batch)."""
    res = run_bench(tmp_path, "--extra-compile", "layers", "--compile-backend", "aot_eager", "--extra-ac", "",
                    "--skip-direct", "--iters", "1")
    runs = res["runs"]
    assert [(r["router_replay"], r["compile"]) for r in runs] == [(False, "none"), (True, "none"),
                                                                   (False, "layers"), (True, "layers")]
    assert all(r["compile_backend"] == "aot_eager" and r["weights_changed_frac"] > 0.5 for r in runs)
    for eager, compiled in ((runs[0], runs[2]), (runs[1], runs[3])):
        assert compiled["last_step_stats"]["num_loss_tokens"] == eager["last_step_stats"]["num_loss_tokens"]


def test_model_parity_compiled_column(tmp_path):
    """benchmarks/model_parity.py's 'ours compiled' column runs on CPU with aot_eager."""
    out = tmp_path / "mp.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-m", "benchmarks.model_parity", "--families", "qwen3_moe", "--compile", "on",
                        "--compile-backend", "aot_eager", "--iters", "1", "--batch", "2", "--seq", "16",
                        "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    row = json.loads(out.read_text())["rows"][0]
    assert row["ours_compiled_tokens_per_s"] > 0 and row["ratio_ours_compiled_over_hf"] > 0
    assert row["logits_rel_err"] < 1e-5
