"""`slurmrl experiment=tiny_local cluster=local_slurm` on the real local cluster.

One heterogeneous job with one component per role group (orchestrator / inference workers /
trainer; no router component with the embedded engine), followed by the CLI until it ends.
Every part and step must end COMPLETED in sacct, and the run directory must hold the same
metrics.jsonl a local run writes (same fields, one record per step, reward logged).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.slurm.conftest import REPO, SMALL, metrics, sacct_final, slurmrl

pytestmark = pytest.mark.slurm

def test_tiny_local_runs_as_one_hetjob(slurm_cluster, tmp_path):
    run_dir = tmp_path / "slurm_run"
    t0 = time.monotonic()
    res = slurmrl(["cluster=local_slurm", *SMALL, "trainer.num_steps=4", f"launcher.run_dir={run_dir}"], tmp_path)
    elapsed = time.monotonic() - t0
    assert res.returncode == 0, (run_dir / "logs").exists() and os.listdir(run_dir / "logs")
    job_id = (run_dir / "slurm" / "job_id").read_text().strip()
    assert f"job {job_id} ended COMPLETED" in res.stdout
    assert "step   4/4 | reward" in res.stdout  # the CLI followed the job's progress
    rows = sacct_final(job_id, num_parts=3, num_steps=3)
    assert set(rows.values()) == {"COMPLETED"}, rows
    assert len([r for r in rows if "." not in r]) == 3  # three het components
    status = subprocess.run([sys.executable, "-m", "launcher", "status", str(run_dir)], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert status.returncode == 0 and f"job {job_id}: COMPLETED" in status.stdout and "4 trainer steps" in status.stdout
    logs = {p.name for p in (run_dir / "logs").iterdir()}
    assert {"orchestrator_0.log", "inference_0.log", "inference_1.log", "trainer_0.log", f"slurm-{job_id}.out"} <= logs

    local_dir = tmp_path / "local_run"
    assert slurmrl(["cluster=local", *SMALL, "trainer.num_steps=4", f"launcher.run_dir={local_dir}"], tmp_path).returncode == 0
    on_slurm, local = metrics(run_dir), metrics(local_dir)
    assert [r["step"] for r in on_slurm] == [r["step"] for r in local] == [1, 2, 3, 4]
    assert [sorted(r) for r in on_slurm] == [sorted(r) for r in local]
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in on_slurm)
    print(f"slurm run took {elapsed:.1f}s")
