"""Hydra multirun on the local cluster: one heterogeneous job per sweep point, all complete.

    slurmrl -m trainer.lr=1e-4,3e-4 cluster=local_slurm ...

The CLI prepares both points, submits two hetjobs, prints their ids, writes sweep.json and
waits for both; each point has its own run directory with its own learning rate.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.slurm.conftest import SMALL, metrics, sacct_final, slurmrl
from workers.common.config import load_run_config

pytestmark = pytest.mark.slurm


def test_multirun_submits_one_hetjob_per_point(slurm_cluster, tmp_path):
    res = slurmrl(["-m", "trainer.lr=1e-4,3e-4", "cluster=local_slurm", *SMALL, "trainer.num_steps=3"], tmp_path,
                  timeout=400)
    assert res.returncode == 0
    assert "sweep: submitted 2 jobs:" in res.stdout and "sweep: 2/2 jobs COMPLETED" in res.stdout
    # job names carry the swept value: slurmrl-<experiment>-<hash>-lr=<value>
    listed = re.findall(r"job (\d+)  #(\d) (slurmrl-\S+-lr=(\S+))  (\S+)", res.stdout)
    assert len(listed) == 2 and len({j for j, *_ in listed}) == 2
    (manifest,) = (tmp_path / "runs" / "multirun").glob("*/sweep.json")  # this sweep's own directory
    record = json.loads(manifest.read_text())
    assert record["dry_run"] is False
    assert [r["job_id"] for r in record["points"]] == [j for j, *_ in listed]
    assert [r["job_name"] for r in record["points"]] == [name for _, _, name, *_ in listed]
    for job_id, _num, _name, lr, run_dir in listed:
        rows = sacct_final(job_id, num_parts=3, num_steps=3)
        assert set(rows.values()) == {"COMPLETED"}, rows
        cfg = load_run_config(f"{run_dir}/config/run.yaml")
        assert cfg.trainer.lr == float(lr) and cfg.launcher.run_dir == run_dir
        assert [r["step"] for r in metrics(Path(run_dir))] == [1, 2, 3]


def test_bad_point_stops_the_sweep_before_any_submission(slurm_cluster, tmp_path):
    res = slurmrl(["-m", "trainer.lr=1e-4,-1", "cluster=local_slurm", *SMALL, "trainer.num_steps=3"], tmp_path, timeout=120)
    assert res.returncode == 2 and "trainer.lr must be > 0, got -1" in res.stderr
    assert "submitted" not in res.stdout
    assert not [p for p in (tmp_path / "runs").glob("tiny_local-*")]
