"""nccl-tests wrapper: build the srun command, run it, parse the table it prints.

The binaries (all_reduce_perf, all_gather_perf, alltoall_perf, sendrecv_perf) come from
``cluster.preflight.nccl_tests_dir``. Built with MPI=1 they run one task per GPU under
``srun --mpi=<nccl_tests_mpi>`` (-g 1), which is how they span nodes; built without MPI a
single task drives every GPU of one node (-g G). Rank 0 prints (nccl-tests' documented
format, a header line naming the columns)::

    #                                                              out-of-place                       in-place
    #       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
    #        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
       134217728      33554432     float     sum      -1   1186.3  113.14  197.99      0   1183.9  113.37  198.40      0
    # Out of bounds values : 0 OK
    # Avg bus bandwidth    : 62.1544

The parser reads the columns from the header (older versions lack ``root`` or say ``error``
for ``#wrong``), skips interleaved NCCL INFO lines and srun ``--label`` / mpirun tag prefixes,
and marks a table without the closing "Avg bus bandwidth" line as truncated.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Optional

from workers.common.config import PreflightConfig
from workers.preflight.bandwidth import CollectiveResult, Measurement, SizeRow

_PREFIX = re.compile(r"^(?:\[\d+,\d+\]<std(?:out|err)>:|\s*\d+: )")
_AVG = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*([0-9.eE+-]+)")
_OOB = re.compile(r"^#\s*Out of bounds values\s*:\s*(\d+)")
_RANK = re.compile(r"^#\s+Rank\s+\d+\s")
LEAD = ("size", "count", "type", "redop", "root")
MEASURE = ("time", "algbw", "busbw")


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def _measurement(tokens: list[str], wrong_col: str) -> Optional[Measurement]:
    time_us, algbw, busbw = (_number(t) for t in tokens[:3])
    if time_us is None or algbw is None or busbw is None:
        return None
    wrong = None
    if wrong_col == "#wrong" and tokens[3].isdigit():
        wrong = int(tokens[3])  # "N/A" when run with -c 0 (no validation)
    return Measurement(time_us=time_us, algbw_gbps=algbw, busbw_gbps=busbw, wrong=wrong)


def parse_output(text: str, collective: str, *, num_ranks: int = 0) -> CollectiveResult:
    """One nccl-tests run's stdout -> CollectiveResult (rows in printed order).

    ``num_ranks`` is used when the output has no "# Rank ..." device lines to count.
    """
    columns: Optional[list[str]] = None
    rows: list[SizeRow] = []
    avg, oob, ranks, partial = None, None, 0, False
    for raw in text.splitlines():
        line = _PREFIX.sub("", raw.rstrip())
        if not line.strip():
            continue
        if line.startswith("#"):
            if _RANK.match(line):
                ranks += 1
            elif (m := _AVG.match(line)) is not None:
                avg = float(m.group(1))
            elif (m := _OOB.match(line)) is not None:
                oob = int(m.group(1))
            else:
                tokens = line[1:].split()
                if tokens[:1] == ["size"] and "busbw" in tokens:
                    columns = tokens
            continue
        tokens = line.split()
        if columns is None or not tokens[0].isdigit():
            continue  # banner text, NCCL INFO lines, warnings
        if len(tokens) != len(columns):
            partial = True  # a row cut off mid-line: the process died while printing
            continue
        partial = False
        row = _row(dict(zip(columns, tokens)), tokens, columns)
        if row is not None:
            rows.append(row)
    return CollectiveResult(collective=collective, tool="nccl-tests", num_ranks=ranks or num_ranks, rows=rows,
                            avg_busbw_gbps=avg, complete=avg is not None and not partial, out_of_bounds=oob,
                            error=None if columns is not None or rows else _no_table(text))


def _row(by_name: dict[str, str], tokens: list[str], columns: list[str]) -> Optional[SizeRow]:
    first = columns.index("time")
    groups = []
    for start in range(first, len(columns) - 3, 4):  # (time, algbw, busbw, #wrong|error) per variant
        m = _measurement(tokens[start:start + 4], columns[start + 3])
        if m is not None:
            groups.append(m)
    if not groups:
        return None
    root = by_name.get("root", "-1")
    return SizeRow(size_bytes=int(by_name["size"]), count=int(by_name.get("count", "0")), dtype=by_name.get("type", "?"),
                   redop=by_name.get("redop", "none"), root=int(root) if root.lstrip("-").isdigit() else -1,
                   out_of_place=groups[0], in_place=groups[1] if len(groups) > 1 else None)


def _no_table(text: str) -> str:
    tail = " | ".join(line.strip() for line in text.strip().splitlines()[-3:])
    return f"no result table in the output ({tail or 'empty output'})"


def perf_args(limits: PreflightConfig, gpus_per_task: int) -> list[str]:
    return ["-b", str(limits.min_bytes), "-e", str(limits.max_bytes), "-f", str(limits.size_factor),
            "-n", str(limits.num_iters), "-w", str(limits.num_warmup_iters), "-c", "1", "-g", str(gpus_per_task)]


def binary(limits: PreflightConfig, collective: str) -> Path:
    return Path(str(limits.nccl_tests_dir)).expanduser() / f"{collective}_perf"


def srun_command(limits: PreflightConfig, collective: str, *, het_group: Optional[int], num_nodes: int,
                 gpus_per_node: int) -> list[str]:
    """The Slurm step for one test over a component's nodes (flags sorted, like render.py's)."""
    mpi = limits.nccl_tests_mpi != "none"
    if not mpi and num_nodes > 1:
        raise ValueError(f"cluster.preflight.nccl_tests_mpi=none runs one process per node, which cannot span "
                         f"{num_nodes} nodes: build nccl-tests with MPI=1 and set nccl_tests_mpi (e.g. pmix)")
    per_node = gpus_per_node if mpi else 1
    opts = {"nodes": num_nodes, "ntasks": num_nodes * per_node, "ntasks-per-node": per_node,
            "gpus-per-node": gpus_per_node, "cpus-per-task": 1, "kill-on-bad-exit": 1, "exact": "",
            "job-name": f"preflight-{collective}"}
    if het_group is not None:
        opts["het-group"] = het_group
    if mpi:
        opts["mpi"] = limits.nccl_tests_mpi
    flags = [f"--{k}" if v == "" else f"--{k}={v}" for k, v in sorted(opts.items())]
    return ["srun", *flags, str(binary(limits, collective)), *perf_args(limits, 1 if mpi else gpus_per_node)]


def local_command(limits: PreflightConfig, collective: str, num_gpus: int) -> list[str]:
    """Standalone: one process drives every GPU of this machine (-g N), no Slurm, no MPI."""
    return [str(binary(limits, collective)), *perf_args(limits, num_gpus)]


def run_test(command: list[str], collective: str, *, exe: Path, timeout_s: float, num_ranks: int) -> CollectiveResult:
    """Run one nccl-tests command (``exe`` is the binary in it) and parse its output; errors become ``result.error``."""
    if not exe.is_file():
        return CollectiveResult(collective, "nccl-tests", num_ranks, command=command,
                                error=f"{exe} not found (cluster.preflight.nccl_tests_dir)")
    try:
        res = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        result = parse_output(out, collective, num_ranks=num_ranks)
        result.error = f"did not finish within {timeout_s:.0f}s (cluster.preflight.timeout_s) after {len(result.rows)} row(s)"
        result.command = command
        return result
    result = parse_output(res.stdout, collective, num_ranks=num_ranks)
    result.command = command
    if res.returncode != 0:
        tail = " | ".join((res.stderr or res.stdout).strip().splitlines()[-3:])
        result.error = f"exit status {res.returncode} after {len(result.rows)} row(s): {tail}"
    return result

