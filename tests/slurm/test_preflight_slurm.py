"""``slurmrl ... preflight=true`` on the real local cluster: the job's first step checks every node.

The local cluster's nodes have no GPU, which gives a real failing case: requiring one GPU on
the trainer's node (``cluster.preflight.expect_gpus_per_node.trainer=1``) must stop the job
with a report naming that node and why (NVML finds no driver), before any role starts. The
passing case measures gloo bandwidth across the inference component's two nodes
(``benchmark_cpu_components``), then the roles run as usual.
"""
from __future__ import annotations

import json
import re

import pytest

from tests.slurm.conftest import SMALL, slurmrl

pytestmark = pytest.mark.slurm
ROLE_LOGS = ("orchestrator_0.log", "inference_0.log", "trainer_0.log")


def test_failing_preflight_stops_the_job_before_roles_start(slurm_cluster, tmp_path):
    run_dir = tmp_path / "preflight_fail"
    res = slurmrl(["cluster=local_slurm", *SMALL, "trainer.num_steps=2", "preflight=true",
                   "+cluster.preflight.expect_gpus_per_node.trainer=1", f"launcher.run_dir={run_dir}"], tmp_path)
    assert res.returncode == 1
    job_id = (run_dir / "slurm" / "job_id").read_text().strip()
    assert f"job {job_id} ended FAILED" in res.stdout
    # the CLI shows the batch log's tail: the report is in the user's terminal
    assert "[preflight] 4 node(s), 0 GPU(s) checked: FAILED (1 problem(s))" in res.stdout
    assert re.search(r"FAIL node\d \(het group 2, trainer\): gpu_count: expected 1 GPU\(s\) "
                     r"\(cluster.preflight.expect_gpus_per_node.trainer\), NVML: NVML library not found", res.stdout)
    batch = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert "preflight failed: no role was started" in batch and "started orchestrator" not in batch
    assert not any((run_dir / "logs" / name).exists() for name in ROLE_LOGS)
    summary = json.loads((run_dir / "preflight" / "summary.json").read_text())
    assert not summary["ok"] and summary["num_nodes"] == 4
    assert [(f["check"], f["level"]) for f in summary["findings"]] == [("gpu_count", "fail")]
    assert len(list((run_dir / "preflight").glob("node_g*_node*.json"))) == 4  # every node reported


def test_passing_preflight_measures_then_starts_the_roles(slurm_cluster, tmp_path):
    run_dir = tmp_path / "preflight_ok"
    res = slurmrl(["cluster=local_slurm", *SMALL, "trainer.num_steps=2", "preflight=true",
                   "cluster.preflight.benchmark_cpu_components=true", "cluster.preflight.min_bytes=16384",
                   "cluster.preflight.max_bytes=65536", "cluster.preflight.num_iters=3", f"launcher.run_dir={run_dir}"],
                  tmp_path)
    assert res.returncode == 0
    job_id = (run_dir / "slurm" / "job_id").read_text().strip()
    batch = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert batch.index("preflight passed") < batch.index("started orchestrator")
    assert "4 node(s), 0 GPU(s) checked: OK" in batch
    assert "bandwidth het group 1 (inference, 2 node(s)): all_reduce: busbw" in batch
    results = json.loads((run_dir / "preflight" / "bandwidth_g1.json").read_text())["results"]
    assert [(r["collective"], r["tool"], r["num_ranks"]) for r in results] == [
        ("all_reduce", "torch-gloo", 2), ("all_gather", "torch-gloo", 2), ("alltoall", "torch-gloo", 2),
        ("sendrecv", "torch-gloo", 2)]
    assert all(row["out_of_place"]["busbw_gbps"] > 0 and row["out_of_place"]["wrong"] == 0
               for r in results for row in r["rows"])
    assert (run_dir / "metrics.jsonl").read_text().count("\n") == 2  # then the run itself
