"""The built-in collective benchmark with 2 real gloo processes, and ``slurmrl-preflight standalone``.

CI has no GPU and no nccl-tests, so this is where the bandwidth path runs for real: two
spawned processes meet through a FileStore, run all_reduce / all_gather / alltoall /
sendrecv on known data (0 wrong elements) and report busbw computed with nccl-tests'
formulas. The nccl-tests runner is driven by stand-in binaries (``fake_*`` scripts that print
a table in nccl-tests' format) to cover exit codes, truncation and the deadline.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from workers.preflight import bench
from workers.preflight.bandwidth import BUSBW_FACTOR, evaluate
from workers.preflight.nccl_tests import run_test
from tests.conftest import ALL_REDUCE

REPO = Path(__file__).resolve().parents[2]
SMALL = ["min_bytes=65536", "max_bytes=262144", "num_iters=3", "num_warmup_iters=1"]


def test_gloo_benchmark_two_processes_reports_busbw(tmp_path):
    out = tmp_path / "bench.json"
    sizes = bench.message_sizes(64 << 10, 256 << 10, 4)
    assert sizes == [64 << 10, 256 << 10]
    bench.run_node(node_rank=0, num_nodes=1, nprocs=2, store=str(tmp_path / "store"), out=str(out),
                   collectives=["all_reduce", "all_gather", "alltoall", "sendrecv"], sizes=sizes, iters=3, warmup=1,
                   device="cpu", timeout_s=60)
    results = bench.read_results(out)
    assert [r.collective for r in results] == ["all_reduce", "all_gather", "alltoall", "sendrecv"]
    for r in results:
        assert r.tool == "torch-gloo" and r.num_ranks == 2 and r.error is None
        assert [row.size_bytes for row in r.rows] == sizes
        for row in r.rows:
            m = row.out_of_place
            assert m.wrong == 0 and m.time_us > 0 and m.busbw_gbps > 0
            assert m.algbw_gbps == pytest.approx(row.size_bytes / (m.time_us * 1e-6) / 1e9, rel=1e-6)
            assert m.busbw_gbps == pytest.approx(m.algbw_gbps * BUSBW_FACTOR[r.collective](2))
        print(r.headline())
    impossible = evaluate(results[0], where="vm (CPU, gloo)", thresholds={"all_reduce": 1e6}, threshold_key="k")
    assert [f.check for f in impossible] == ["busbw"] and "over 2 ranks" in impossible[0].message


def test_one_rank_measures_and_skips_sendrecv(tmp_path):
    """A 1-GPU machine: collectives run (busbw 0 by the formulas), sendrecv is skipped, nothing fails."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        results = [bench.measure(c, [4096], iters=2, warmup=1, device=torch.device("cpu"))
                   for c in ("all_reduce", "sendrecv")]
    finally:
        dist.destroy_process_group()
    assert results[0].rows[0].out_of_place.wrong == 0 and results[0].rows[0].out_of_place.busbw_gbps == 0.0
    assert results[1].skipped == "needs 2 or more ranks" and results[1].rows == []
    assert results[1].headline() == "sendrecv: skipped (torch-gloo): needs 2 or more ranks"
    assert [f.level for r in results for f in evaluate(r, where="w", thresholds={"all_reduce": 300.0},
                                                        threshold_key="k")] == ["warn"]  # 1 rank: not judged


def preflight(args: list[str], *, timeout: float = 240) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "workers.preflight", *args], cwd=REPO, capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    print(res.stdout[-3000:], res.stderr[-3000:])
    return res


def test_standalone_on_cpu_passes_and_writes_reports(tmp_path):
    res = preflight(["standalone", "--out", str(tmp_path), *SMALL])
    assert res.returncode == 0
    assert "[preflight] 1 node(s), 0 GPU(s) checked: OK" in res.stdout
    assert "all_reduce: busbw" in res.stdout and "(torch-gloo, 2 ranks)" in res.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] and len(summary["bandwidth"]) == 1
    results = json.loads((tmp_path / "bandwidth.json").read_text())["results"]
    assert [r["collective"] for r in results] == ["all_reduce", "all_gather", "alltoall", "sendrecv"]
    assert all(row["out_of_place"]["busbw_gbps"] > 0 for r in results for row in r["rows"])
    assert len(list(tmp_path.glob("node_*.json"))) == 1


def test_standalone_expecting_a_gpu_on_a_cpu_machine_fails_clearly(tmp_path):
    res = preflight(["standalone", "--out", str(tmp_path), "--expect-gpus", "1", "--cluster", "h200_ib", *SMALL])
    assert res.returncode == 1
    assert "checked: FAILED (1 problem(s))" in res.stdout
    assert "gpu_count: expected 1 GPU(s) (--expect-gpus)" in res.stdout
    assert "bandwidth: not measured (node checks failed)" in res.stdout
    assert not json.loads((tmp_path / "summary.json").read_text())["ok"]


def test_standalone_usage_errors(tmp_path):
    res = preflight(["standalone", "--out", str(tmp_path), "--cluster", "nope"])
    assert res.returncode != 0 and "no cluster profile 'nope'; choose one of" in res.stderr
    res = preflight(["standalone", "--out", str(tmp_path), "max_bytes"])
    assert res.returncode != 0 and "overrides must be key=value" in res.stderr


def fake_binary(directory: Path, name: str, body: str) -> Path:
    path = directory / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_nccl_tests_runner_with_fake_binaries(tmp_path):
    table = tmp_path / "table.txt"
    table.write_text(ALL_REDUCE)
    ok = fake_binary(tmp_path, "fake_all_reduce_perf", f'cat {table}\n')
    r = run_test([str(ok), "-b", "8"], "all_reduce", exe=ok, timeout_s=30, num_ranks=16)
    assert r.error is None and r.complete and len(r.rows) == 6 and r.command == [str(ok), "-b", "8"]
    crash = fake_binary(tmp_path, "fake_crash_perf", f'head -c 2000 {table}\necho "Test NCCL failure common.cu:1279" >&2\n'
                                                      "exit 3\n")
    r = run_test([str(crash)], "all_reduce", exe=crash, timeout_s=30, num_ranks=16)
    assert r.error.startswith("exit status 3 after") and "Test NCCL failure" in r.error and not r.complete
    hang = fake_binary(tmp_path, "fake_hang_perf", f'head -c 2200 {table}\nsleep 30\n')
    r = run_test([str(hang)], "all_reduce", exe=hang, timeout_s=1, num_ranks=16)
    assert "did not finish within 1s (cluster.preflight.timeout_s)" in r.error
    missing = tmp_path / "nope" / "sendrecv_perf"
    r = run_test([str(missing)], "sendrecv", exe=missing, timeout_s=1, num_ranks=2)
    assert r.error == f"{missing} not found (cluster.preflight.nccl_tests_dir)"
