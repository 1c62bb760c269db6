"""benchmarks/lora.py's three paths at toy size: the CPU comparison (``--toy``: full, LoRA r8 and r32 as
real local runs), the GLM-5 plan numbers (torch-free) and the GPU step (``--gpu-step --toy`` on the CPU),
so a drift in the launcher, the trainer's LoRA mode or the plan fails here, not during a 25-minute
SmolLM2 run or on rented GPU time.

Each benchmark run is a subprocess (it starts runs, or a process group of world 1).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def bench(out: Path, *args: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-m", "benchmarks.lora", *args, "--out", str(out)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


@pytest.mark.slow
def test_toy_runs_full_and_lora_side_by_side(tmp_path):
    bench(tmp_path, "--toy", "--no-plan")
    res = json.loads((tmp_path / "lora_toy.json").read_text())
    runs = {r["name"]: r for r in res["runs"]}
    assert list(runs) == ["full", "lora_r8", "lora_r32"]
    full, r8, r32 = runs["full"], runs["lora_r8"], runs["lora_r32"]
    for r in runs.values():
        assert r["steps"] == res["steps"] == 4, r["per_step"]
        assert 0.0 <= r["reward_first5"] <= 1.0 and r["step_time_s_median"] > 0 and r["trainer_peak_rss_gib"] > 0
    assert r8["lr"] == r32["lr"] == pytest.approx(10 * full["lr"])  # LoRA at lr x10, the rest the same
    # the update is the adapter: PEFT files of exactly the trainable parameters (float32 here) ...
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(r8["update_files"])
    assert "model.safetensors" in full["update_files"]
    for r in (r8, r32):
        assert r["weight_bytes_metric_median"] == 4 * r["trainable_params"], r
        assert r["update_bytes"] > r["weight_bytes_metric_median"]  # + the config, sidecar, safetensors header
    assert r32["trainable_params"] == 4 * r8["trainable_params"]
    # ... a fraction of the dense step's bytes, rank 8 a quarter of rank 32's
    assert r8["update_over_dense"] < r32["update_over_dense"] < 1.0
    assert r8["update_over_dense"] == pytest.approx(r8["update_bytes"] / full["update_bytes"])
    assert r8["lora_over_full"] == pytest.approx(r8["reward_last5"] / full["reward_last5"])
    assert r8["planned_states_gb"] < full["planned_states_gb"]  # no fp32 master / grad / AdamW for the base
    assert set(res["summary"]) == {"lora_r8", "lora_r32", "within_10pct"}


def test_glm5_plan_with_lora():
    from benchmarks.lora_glm5_plan import glm5_plans

    p = glm5_plans()
    full, lora = p["full"], p["lora"]
    assert full["trainer_ranks"] == lora["trainer_ranks"] == 128
    assert lora["rank"] == 32 and "ep(1)" in lora["trainer_dims"] and "ep(8)" in full["trainer_dims"]
    assert lora["lr"] == pytest.approx(10 * full["lr"])
    # frozen bf16 base: 2 B/param instead of 16, plus 16 B per adapter parameter
    assert lora["trainer_states_gb_per_gpu"] == pytest.approx(
        (2 * lora["base_params"] + 16 * lora["trainable_params"]) / 128 / 1e9)
    assert p["states_lora_over_full"] < 0.2 and p["total_lora_over_full"] < 0.5
    assert p["update_bytes_lora_over_dense"] < 0.02
    assert lora["update_read_s"] < full["update_dense_broadcast_s"]
    small = p["lora_smallest_trainer"]
    assert small["trainer_nodes"] < p["preset_trainer_nodes"] and small["trainer_total_gb_per_gpu"] < 0.9 * 141
    assert f"{lora['trainer_states_gb_per_gpu']:.1f} GB" in lora["plan_memory_line"]  # the plan's own numbers


@pytest.mark.slow
def test_gpu_step_toy_on_cpu(tmp_path):
    bench(tmp_path, "--gpu-step", "--toy")
    res = json.loads((tmp_path / "lora_step.json").read_text())
    rows = {r["name"]: r for r in res["rows"]}
    assert list(rows) == ["lora_r8", "lora_r32", "full"]
    full, r8, r32 = rows["full"], rows["lora_r8"], rows["lora_r32"]
    assert res["shape"]["num_experts"] == 16 and res["shape"]["num_hidden_layers"] == 2  # model_parity's toy widths
    assert r32["trainable"] == 4 * r8["trainable"] and r32["trainable"] < full["trainable"] == full["params"]
    assert r8["params"] == full["params"] + r8["trainable"]  # the same base, plus the adapters
    for r in (r8, r32):
        assert r["step_s"] > 0 and r["step_over_full"] == pytest.approx(r["step_s"] / full["step_s"])
