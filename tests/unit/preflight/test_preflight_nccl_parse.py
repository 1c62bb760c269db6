"""nccl-tests output parsing and judging (workers/preflight/nccl_tests.py, bandwidth.py).

The outputs below are written by hand in nccl-tests' documented format (README and
doc/PERFORMANCE.md of NVIDIA/nccl-tests: banner, "# Using devices" lines, a two-line header,
one row per size with out-of-place and in-place time/algbw/busbw/#wrong, then "Out of bounds
values" and "Avg bus bandwidth"), including what real runs add: NCCL INFO lines in the table,
srun --label prefixes, a row with #wrong > 0, N/A when validation is off, an older header
without ``root`` and with ``error``, and a run cut off mid-table.
"""
from __future__ import annotations

import pytest

from workers.common.config import PreflightConfig
from workers.preflight.bandwidth import BUSBW_FACTOR, evaluate
from workers.preflight.nccl_tests import local_command, parse_output, srun_command
from tests.conftest import HEADER, BANNER, ALL_REDUCE


def test_all_reduce_table_parses_every_column():
    r = parse_output(ALL_REDUCE, "all_reduce")
    assert r.complete and r.error is None and r.num_ranks == 16 and r.avg_busbw_gbps == pytest.approx(237.1492)
    assert [row.size_bytes for row in r.rows] == [1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]
    top = r.rows[-1]
    assert (top.count, top.dtype, top.redop, top.root) == (268435456, "float", "sum", -1)
    assert (top.out_of_place.time_us, top.out_of_place.algbw_gbps, top.out_of_place.busbw_gbps,
            top.out_of_place.wrong) == (4911.3, 218.63, 409.93, 0)
    assert top.in_place.busbw_gbps == 410.44 and top.best_busbw == 410.44
    assert r.out_of_bounds == 0
    # the table obeys nccl-tests' formulas: algbw = S/t, busbw = algbw * 2(n-1)/n
    assert top.size_bytes / (top.out_of_place.time_us * 1e-6) / 1e9 == pytest.approx(top.out_of_place.algbw_gbps, rel=1e-3)
    assert top.out_of_place.algbw_gbps * BUSBW_FACTOR["all_reduce"](16) == pytest.approx(409.93, rel=1e-3)


def test_busbw_factors_are_nccl_tests_formulas():
    n = 8
    assert BUSBW_FACTOR["all_reduce"](n) == 2 * 7 / 8
    assert BUSBW_FACTOR["all_gather"](n) == BUSBW_FACTOR["alltoall"](n) == 7 / 8
    assert BUSBW_FACTOR["sendrecv"](n) == 1.0


def test_nccl_info_lines_and_srun_labels_inside_the_table_are_skipped():
    text = BANNER + HEADER + """\
gpu-000:4100:4100 [0] NCCL INFO Launch mode Parallel
     1048576         16384     float    none      -1    35.10   29.87   26.14      0    34.80   30.13   26.37      0
gpu-001:4108:4120 [0] NCCL INFO Channel 02/0 : 15[7] -> 0[0] [send] via NET/IB/0/GDRDMA
  1073741824      16777216     float    none      -1   3390.2  316.72  277.13      0   3385.7  317.14  277.50      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 151.7850
"""
    labelled = "\n".join(f"0: {line}" for line in text.splitlines())
    for t in (text, labelled):
        r = parse_output(t, "all_gather")
        assert r.complete and len(r.rows) == 2 and r.num_ranks == 16
        assert r.rows[-1].redop == "none" and r.rows[-1].out_of_place.busbw_gbps == 277.13


def test_wrong_elements_fail_with_size_and_variant():
    text = BANNER + HEADER + """\
     1048576         16384     float    none      -1    60.21   17.42   15.24      0    59.98   17.48   15.30      0
    16777216        262144     float    none      -1    402.7   41.66   36.45     12    401.9   41.74   36.53      0
  1073741824      16777216     float    none      -1    22874   46.94   41.07      0    22861   46.97   41.10      3
# Out of bounds values : 15 FAILED
# Avg bus bandwidth    : 30.9483
"""
    r = parse_output(text, "alltoall")
    assert [row.out_of_place.wrong for row in r.rows] == [0, 12, 0]
    assert [row.in_place.wrong for row in r.rows] == [0, 0, 3] and r.out_of_bounds == 15
    found = evaluate(r, where="het group 3 (trainer, 2 node(s))", thresholds={"alltoall": 40.0},
                     threshold_key="cluster.preflight.min_busbw_gbps")
    messages = [f.message for f in found if f.check == "wrong"]
    assert "alltoall (nccl-tests): 12 wrong element(s) at 16 MiB (out-of-place): data corruption on a GPU or link" in messages
    assert any("3 wrong element(s) at 1 GiB (in-place)" in m for m in messages)
    assert any("15 out-of-bounds values" in m for m in messages)
    assert not any(f.check == "busbw" for f in found)  # 41.10 >= 40: bandwidth itself is fine
    assert all(f.level == "fail" and f.where == "het group 3 (trainer, 2 node(s))" for f in found)


def test_truncated_output_keeps_rows_and_fails():
    cut = ALL_REDUCE[:ALL_REDUCE.index("    67108864")] + "    67108864      16777216     float     sum      -1    404.9  16"
    r = parse_output(cut, "all_reduce")
    assert not r.complete and r.avg_busbw_gbps is None
    assert [row.size_bytes for row in r.rows] == [1 << 20, 4 << 20, 16 << 20]  # the partial row is dropped
    found = evaluate(r, where="het group 2 (trainer, 2 node(s))", thresholds={}, threshold_key="k")
    assert [f.check for f in found] == ["truncated"]
    assert "output ends after 3 row(s), before nccl-tests' closing '# Avg bus bandwidth' line" in found[0].message
    # cut between rows: no partial line, still truncated (no closing lines)
    r2 = parse_output(ALL_REDUCE[:ALL_REDUCE.index("# Out of bounds")], "all_reduce")
    assert not r2.complete and len(r2.rows) == 6


def test_busbw_below_threshold_names_the_key_and_numbers():
    r = parse_output(ALL_REDUCE, "all_reduce")
    found = evaluate(r, where="het group 3 (trainer, 2 node(s))", thresholds={"all_reduce": 450.0},
                     threshold_key="cluster.preflight.min_busbw_gbps")
    assert [f.line() for f in found] == [
        "FAIL het group 3 (trainer, 2 node(s)): busbw: all_reduce (nccl-tests): busbw 410.44 GB/s at 1 GiB < "
        "cluster.preflight.min_busbw_gbps.all_reduce(450) over 16 ranks"]
    assert evaluate(r, where="x", thresholds={"all_reduce": 400.0}, threshold_key="k") == []
    assert r.headline() == "all_reduce: busbw 410.44 GB/s at 1 GiB (nccl-tests, 16 ranks)"


def test_older_header_without_root_and_validation_off():
    text = """\
# nThread 1 nGpus 8 minBytes 8 maxBytes 134217728 step: 2(factor) warmup iters: 5 iters: 20 validation: 0
#                                                     out-of-place                       in-place
#       size         count    type   redop     time   algbw   busbw  error     time   algbw   busbw  error
#        (B)    (elements)                     (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
   134217728      33554432   float     sum   1186.3  113.14  197.99  5e-07   1183.9  113.37  198.40  5e-07
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 198.195
"""
    r = parse_output(text, "all_reduce", num_ranks=8)
    assert r.complete and r.num_ranks == 8 and r.rows[0].root == -1 and r.rows[0].out_of_place.wrong is None
    na = ALL_REDUCE.replace("      0    4", "    N/A    4")
    assert parse_output(na, "all_reduce").rows[0].out_of_place.wrong is None


def test_output_without_a_table_is_an_error_with_its_last_lines():
    text = "gpu-000: Test NCCL failure common.cu:1279 'unhandled system error'\n .. gpu-000 pid 4100: Test failure common.cu:1102\n"
    r = parse_output(text, "sendrecv")
    assert r.rows == [] and "no result table in the output" in r.error and "unhandled system error" in r.error
    assert [f.check for f in evaluate(r, where="w", thresholds={}, threshold_key="k")] == ["benchmark"]


def test_srun_and_local_commands():
    limits = PreflightConfig(nccl_tests_dir="/opt/nccl-tests/build", min_bytes=1 << 20, max_bytes=1 << 30)
    cmd = srun_command(limits, "all_reduce", het_group=3, num_nodes=2, gpus_per_node=8)
    assert cmd[:10] == ["srun", "--cpus-per-task=1", "--exact", "--gpus-per-node=8", "--het-group=3",
                        "--job-name=preflight-all_reduce", "--kill-on-bad-exit=1", "--mpi=pmix", "--nodes=2",
                        "--ntasks=16"]
    assert cmd[10:12] == ["--ntasks-per-node=8", "/opt/nccl-tests/build/all_reduce_perf"]
    assert cmd[12:] == ["-b", "1048576", "-e", "1073741824", "-f", "4", "-n", "20", "-w", "5", "-c", "1", "-g", "1"]
    one = srun_command(PreflightConfig(nccl_tests_dir="/x", nccl_tests_mpi="none"), "sendrecv", het_group=1,
                       num_nodes=1, gpus_per_node=8)
    assert "--ntasks-per-node=1" in one and not any(f.startswith("--mpi") for f in one) and one[-2:] == ["-g", "8"]
    with pytest.raises(ValueError, match="nccl_tests_mpi=none runs one process per node, which cannot span 2 nodes"):
        srun_command(PreflightConfig(nccl_tests_dir="/x", nccl_tests_mpi="none"), "sendrecv", het_group=1,
                     num_nodes=2, gpus_per_node=8)
    assert local_command(limits, "alltoall", 4)[0] == "/opt/nccl-tests/build/alltoall_perf"
    assert local_command(limits, "alltoall", 4)[-2:] == ["-g", "4"]
