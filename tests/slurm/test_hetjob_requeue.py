"""Preemption notice on the local cluster: USR1 to the batch shell stops the roles and requeues.

``--signal=B:USR1@<grace>`` delivers USR1 to the batch shell before the time limit; here
``scancel --batch --signal=USR1`` sends it at once (tests/slurm/README.md). The trap stops
every step and runs ``scontrol requeue``; the whole hetjob comes back with
SLURM_RESTART_COUNT=1 and logs into the same run directory. Resuming the roles from the run
dir is the roles' business (Topology.restart_count); this test cancels the second run with
``slurmrl cancel RUN_DIR``.
"""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from launcher import submit
from tests.slurm.conftest import wait_until
from tests.slurm.conftest import REPO, SMALL, slurmrl

pytestmark = pytest.mark.slurm


def test_usr1_requeues_the_whole_hetjob(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    res = slurmrl(["cluster=local_slurm", *SMALL, "trainer.num_steps=1000", "launcher.follow=false",
                   f"launcher.run_dir={run_dir}"], tmp_path, timeout=120)
    assert res.returncode == 0
    job_id = (run_dir / "slurm" / "job_id").read_text().strip()
    log = run_dir / "logs" / f"slurm-{job_id}.out"
    try:
        # The trap only needs the steps to exist; training need not have started.
        wait_until("every step to start", 120, lambda: log.exists() and "started trainer" in log.read_text())
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True, timeout=30)
        wait_until("the requeue", 60, lambda: f"requeueing job {job_id} (restart 0, at most 1)" in log.read_text())
        restarts = wait_until("Restarts=1", 30, lambda: "Restarts=1" in subprocess.run(
            ["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30).stdout)
        assert restarts
        # A requeued job waits cred_expire+1 s (11 s here) before it may start again. Forcing
        # StartTime=now races with that: slurmctld then kills it ("Job credential revoked"). Once eligible,
        # only a backfill pass starts it (conftest.wake_backfill).
        wait_until("the second run of the batch script", 300, lambda: f"job {job_id} (restart 1)" in log.read_text(),
                   wake_every_s=2)
        text = log.read_text()
        first = text[: text.index(f"job {job_id} (restart 1)")]
        assert "USR1: time limit or preemption in 30 s" in first and "exited with status" in first
    finally:
        cancelled = subprocess.run([sys.executable, "-m", "launcher", "cancel", str(run_dir)], cwd=REPO,
                                   capture_output=True, text=True, timeout=60)
    assert cancelled.returncode == 0 and f"cancelled job {job_id}" in cancelled.stdout, cancelled
    t0 = time.monotonic()
    comps = submit.wait_until_done(job_id, timeout_s=60)
    assert {c.state for c in comps} <= {"CANCELLED", "FAILED"}, comps
    print(f"requeued job ended {time.monotonic() - t0:.1f}s after scancel: {submit.describe(comps)}")
