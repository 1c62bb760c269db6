"""The whole loop as local processes: launcher -> trainer + 2 inference workers + orchestrator.

These start the real `slurmrl` CLI (Hydra app) in a subprocess, so they cover composition,
planning, process management, HTTP, the file protocol and the training step together.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launcher.timeline import summarize
from tests.integration.conftest import SMALL, slurmrl, metrics, assert_no_children_left
from workers.common.timeline import read_timeline

REPO = Path(__file__).resolve().parents[2]


REQUIRED_KEYS = {"step", "reward_mean", "max_staleness", "samples_dropped_stale", "mismatch_kl", "trainer_idle_frac",
                 "tokens_per_s", "step_time_s"}


def test_synchronous_run_samples_match_trainer_step(tmp_path):
    run_dir = tmp_path / "sync"
    out = slurmrl([*SMALL, "orchestrator.max_off_policy_steps=0", "trainer.num_steps=4", f"launcher.run_dir={run_dir}"],
                  tmp_path)
    assert f"run directory: {run_dir}" in out.stdout
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for r in recs:
        assert REQUIRED_KEYS <= set(r), f"missing keys {REQUIRED_KEYS - set(r)}"
        # synchronous: every token of step N's samples was produced by the weights step N trains (N-1)
        assert r["policy_version_min"] == r["policy_version_max"] == r["step"] - 1 and r["policy_version"] == r["step"], r
        assert r["max_staleness"] == 0 and r["samples_dropped_stale"] == 0
    # same dtype on both sides, same weights before the first update: logprobs line up
    assert recs[0]["mismatch_kl"] < 1e-3, recs[0]["mismatch_kl"]
    weights = sorted(p.name for p in (run_dir / "weights").iterdir() if p.name.startswith("step_"))
    assert weights == ["step_000002", "step_000003", "step_000004"], weights  # keep_last=3
    assert all((run_dir / "weights" / w / "STABLE").exists() for w in weights)
    assert list((run_dir / "tb").glob("events.out.tfevents.*")), "no TensorBoard event file"
    assert (tmp_path / "runs" / "latest").resolve() == run_dir.resolve()
    # the loop's timeline (workers/common/timeline.py): every step's marks, and the one line at the end
    tl = read_timeline(run_dir)
    assert sorted(tl[("trainer", "step")]) == sorted(tl[("orchestrator", "batch")]) == [1, 2, 3, 4]
    assert {1, 2, 3} <= set(tl[("orchestrator", "apply")])  # the engines moved to weights 1..3
    s = summarize(run_dir)
    # synchronous: a step waits for its batch, whose generation waits for the last step's weights
    assert s["steps"] == 3 and s["loop_interval_over_bound"] >= 0.99, s
    assert "[slurmrl] timeline (3 steps, medians): interval" in out.stdout
    assert_no_children_left(run_dir)


def test_async_staleness_reaches_but_never_exceeds_bound_with_two_trainer_ranks(tmp_path):
    run_dir = tmp_path / "async"
    # The simulated trainer delay makes inference outrun training, as on a real cluster.
    slurmrl([*SMALL, "orchestrator.max_off_policy_steps=2", "trainer.num_steps=7", "trainer.num_ranks=2",
             "trainer.simulated_step_delay_s=1.5", f"launcher.run_dir={run_dir}"], tmp_path)
    recs = metrics(run_dir)
    assert len(recs) == 7
    staleness = [r["max_staleness"] for r in recs]
    assert max(staleness) == 2, staleness
    assert all(r["step"] - 1 - r["policy_version_min"] <= 2 for r in recs)
    assert_no_children_left(run_dir)


def test_ctrl_c_leaves_no_child_process(tmp_path):
    run_dir = tmp_path / "interrupted"
    cmd = [sys.executable, "-m", "launcher", f"cluster.runs_root={tmp_path / 'runs'}", *SMALL,
           "trainer.num_steps=500", f"launcher.run_dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "metrics.jsonl").exists() or not metrics(run_dir):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "no training step within 180 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    assert "stopping all roles" in out
    assert_no_children_left(run_dir)


@pytest.mark.parametrize("override, key", [
    ("orchestrator.num_prompts_per_step=-1", "orchestrator.num_prompts_per_step"),
    ("trainer.num_ranks=1000", "trainer.num_ranks"),
    ("model.num_heads=3", "model.num_heads"),
    ("orchestrator.max_off_policy_steps=-2", "orchestrator.max_off_policy_steps"),
    ("trainer.lr=fast", "trainer.lr"),
    ("cluster=nonexistent", "cluster"),
    ("trainer.no_such_key=1", "no_such_key"),
])
def test_invalid_config_stops_before_anything_starts(tmp_path, override, key):
    out = slurmrl([override], tmp_path, timeout=60, check=False)
    assert out.returncode != 0
    assert key in out.stdout + out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir()), "a run dir was written"
