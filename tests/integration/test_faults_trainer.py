"""Trainer preempted (SIGTERM: checkpoint, exit) and crashed (SIGKILL: last periodic checkpoint)
mid-run (steps slowed to 1 s so the kill lands mid-run on a loaded machine): the launcher restarts it, it resumes from the newest complete checkpoint and the
metrics curve continues with every step exactly once."""
from __future__ import annotations

import json

from benchmarks.chaos import run_chaos


def _resumes(run_dir):
    return [json.loads(x) for x in (run_dir / "checkpoints" / "resumes.jsonl").read_text().splitlines()]


def test_trainer_sigterm_checkpoints_and_resumes_losing_no_step(tmp_path):
    run = tmp_path / "run"
    r = run_chaos(run, num_steps=8, timeout_s=240, schedule=[(3, "trainer[0]", "TERM")],
                  overrides=["trainer.checkpoint_every_steps=0", "trainer.simulated_step_delay_s=1.0"])
    assert r["launcher_exit"] == 0 and r["finished"], r
    (resume,) = _resumes(run)
    assert resume["step"] >= 3 and resume["steps_lost"] == 0, resume
    assert r["steps_missing_in_metrics"] == 0 and r["steps_duplicated_in_metrics"] == 0
    assert r["rollouts_lost"] == 0 and r["rollouts_trained_twice"] == 0
    assert [x["exit_code"] for x in r["restarts"]] == [143]


def test_trainer_sigkill_resumes_from_last_periodic_checkpoint(tmp_path):
    run = tmp_path / "run"
    r = run_chaos(run, num_steps=8, timeout_s=240, schedule=[(5, "trainer[0]", "KILL")],
                  overrides=["trainer.checkpoint_every_steps=2", "trainer.simulated_step_delay_s=1.0"])
    assert r["launcher_exit"] == 0 and r["finished"], r
    (resume,) = _resumes(run)
    assert resume["step"] % 2 == 0 and resume["step"] >= 4 and resume["steps_lost"] <= 1, resume
    assert r["steps_missing_in_metrics"] == 0 and r["steps_duplicated_in_metrics"] == 0
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9)), steps  # one continuous curve
