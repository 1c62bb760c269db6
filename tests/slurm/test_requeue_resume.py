"""``scontrol requeue`` on the local cluster resumes training from the checkpoint.

The flow of test_hetjob_requeue.py (USR1 to the batch shell -> its trap SIGTERMs every step
and requeues), then the part that test leaves to the roles: the trainer's SIGTERM writes a
checkpoint (workers/trainer/checkpoint.py), the second run of the batch script resumes from
it (checkpoints/resumes.jsonl), the orchestrator resumes from its ledger, and metrics.jsonl
continues the same curve: every step once, none redone, none given a group twice.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.slurm.conftest import wait_until
from tests.slurm.conftest import REPO, SMALL, slurmrl
from workers.orchestrator.ledger import read_ledger

pytestmark = pytest.mark.slurm
NUM_STEPS = 14


def _steps(run_dir):
    path = run_dir / "metrics.jsonl"
    return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def test_requeue_resumes_from_checkpoint(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    res = slurmrl(["cluster=local_slurm", *SMALL, f"trainer.num_steps={NUM_STEPS}", "trainer.checkpoint_every_steps=0",
                   "trainer.simulated_step_delay_s=1.0", "launcher.follow=false", f"launcher.run_dir={run_dir}"],
                  tmp_path, timeout=120)
    assert res.returncode == 0, res
    job_id = (run_dir / "slurm" / "job_id").read_text().strip()
    log = run_dir / "logs" / f"slurm-{job_id}.out"
    try:
        wait_until("3 trained steps", 240, lambda: len(_steps(run_dir)) >= 3)
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True, timeout=30)
        wait_until("the second run of the batch script", 300, lambda: f"job {job_id} (restart 1)" in log.read_text(),
                   wake_every_s=2)  # conftest.wake_backfill says why
        resumes = run_dir / "checkpoints" / "resumes.jsonl"
        wait_until("the trainer to resume", 180, lambda: resumes.exists() and resumes.read_text().strip())
        resume = json.loads(resumes.read_text().splitlines()[0])
        assert resume["step"] >= 3 and resume["steps_lost"] == 0, resume  # SIGTERM saved the step in progress
        wait_until("the run to finish", 300, lambda: (run_dir / "TRAINER_DONE").exists())
    finally:
        subprocess.run([sys.executable, "-m", "launcher", "cancel", str(run_dir)], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert _steps(run_dir) == list(range(1, NUM_STEPS + 1))  # one continuous curve across the requeue (1-based)
    led = read_ledger(run_dir / "orchestrator_ledger.jsonl").summary()
    assert led["groups_trained_twice"] == 0 and led["orchestrator_restarts"] >= 1, led
