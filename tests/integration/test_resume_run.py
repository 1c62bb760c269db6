"""``slurmrl launcher.resume=<run_dir>``: a local run killed (SIGKILL of the launcher), resumed,
stopped (SIGINT to the launcher, as Ctrl-C), resumed again with more steps, then, finished,
resumed with more steps once more (from the trainer's final checkpoint, its metrics line cut in half
before: put back from the copy kept at that checkpoint), ends with one
continuous curve: every step in metrics.jsonl exactly once, no group trained twice, nothing
pending (the orchestrator's ledger), the trainer resumed from its SIGTERM checkpoints.
Overrides that change the run's shape are refused with the key named, before anything starts.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.conftest import REPO
from tests.integration.conftest import SMALL, assert_no_children_left, metrics, slurmrl
from workers.orchestrator.ledger import read_ledger

FIRST_STEPS, MORE_STEPS = 8, 10


def _launcher(args: list[str], tmp_path, log_name: str) -> subprocess.Popen:
    log = open(tmp_path / log_name, "w")
    return subprocess.Popen([sys.executable, "-m", "launcher", f"cluster.runs_root={tmp_path / 'runs'}", *args],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _wait_steps(proc: subprocess.Popen, run_dir, n: int, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not ((run_dir / "metrics.jsonl").exists() and len(metrics(run_dir)) >= n):
        assert proc.poll() is None, f"launcher exited {proc.returncode} before step {n}"
        assert time.monotonic() < deadline, f"fewer than {n} steps within {timeout_s} s"
        time.sleep(0.2)


def _resumes(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "checkpoints" / "resumes.jsonl").read_text().splitlines()]


def test_killed_then_stopped_run_resumes_with_every_step_once(tmp_path):
    run_dir = tmp_path / "run"
    base = [*SMALL, "trainer.checkpoint_every_steps=0", "trainer.simulated_step_delay_s=0.5",
            "launcher.shutdown_grace_s=10"]
    first = _launcher([*base, f"trainer.num_steps={FIRST_STEPS}", f"launcher.run_dir={run_dir}"], tmp_path, "1.log")
    try:
        _wait_steps(first, run_dir, 2)
        os.kill(first.pid, signal.SIGKILL)  # the launcher dies; PR_SET_PDEATHSIG stops its children
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == -signal.SIGKILL

    # relaunching into the run dir stays refused; a resume refuses shape changes, naming the key
    again = slurmrl([f"launcher.run_dir={run_dir}"], tmp_path, timeout=60, check=False)
    assert again.returncode == 2 and "already holds a run" in again.stderr, again.stderr
    for override, key in [("orchestrator.num_prompts_per_step=8", "orchestrator.num_prompts_per_step"),
                          ("experiment=tiny_local", "experiment"), ("trainer.num_steps=3", "trainer.num_steps")]:
        res = slurmrl([f"launcher.resume={run_dir}", override], tmp_path, timeout=60, check=False)
        assert res.returncode == 2 and key in res.stderr and "Traceback" not in res.stderr, (override, res.stderr)

    second = _launcher([f"launcher.resume={run_dir}"], tmp_path, "2.log")  # waits for the killed run's children
    try:
        _wait_steps(second, run_dir, 5)
        second.send_signal(signal.SIGINT)  # Ctrl-C
        second.wait(timeout=90)
    finally:
        if second.poll() is None:
            second.kill()
    assert second.returncode == 130, (tmp_path / "2.log").read_text()[-3000:]
    assert_no_children_left(run_dir)
    stopped_at = len(metrics(run_dir))
    assert stopped_at < FIRST_STEPS, "the run finished before it was stopped: slow it down"

    third = slurmrl([f"launcher.resume={run_dir}", f"trainer.num_steps={MORE_STEPS}"], tmp_path, timeout=400)
    assert "resuming" in third.stdout, third.stdout[-2000:]
    assert f"resuming after step {stopped_at}" in third.stdout, third.stdout[-2000:]  # issue 47 item 16
    assert "step   1/" not in third.stdout  # the earlier steps are not printed again
    assert_no_children_left(run_dir)
    assert (run_dir / "TRAINER_DONE").exists()
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, MORE_STEPS + 1))  # each step exactly once
    led = read_ledger(run_dir / "orchestrator_ledger.jsonl").summary()
    assert led["groups_trained_twice"] == 0 and led["groups_pending"] == 0, led
    assert led["orchestrator_restarts"] == 2, led
    resumes = _resumes(run_dir)
    assert len(resumes) == 2 and all(r["steps_lost"] == 0 for r in resumes), resumes  # SIGTERM checkpoints
    assert len((run_dir / "launcher_resumes.jsonl").read_text().splitlines()) == 2

    done = slurmrl([f"launcher.resume={run_dir}"], tmp_path, timeout=60, check=False)
    assert done.returncode == 2 and "already finished" in done.stderr, done.stderr
    text = (run_dir / "metrics.jsonl").read_text()  # the final checkpoint's line cut in half (issue 47 item 4)
    (run_dir / "metrics.jsonl").write_text(text[: len(text) - len(text.splitlines()[-1]) // 2 - 1])
    slurmrl([f"launcher.resume={run_dir}", f"trainer.num_steps={MORE_STEPS + 2}"], tmp_path, timeout=400)
    # a finished run trains further; the cut record of its checkpointed last step is put back, not lost
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, MORE_STEPS + 3))
    assert _resumes(run_dir)[-1] == {**_resumes(run_dir)[-1], "step": MORE_STEPS, "steps_lost": 0}  # final checkpoint
    assert read_ledger(run_dir / "orchestrator_ledger.jsonl").summary()["groups_trained_twice"] == 0
