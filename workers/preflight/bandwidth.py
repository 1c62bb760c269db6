"""Collective bandwidth results, nccl-tests' bus-bandwidth formulas, and the threshold check.

nccl-tests (doc/PERFORMANCE.md) reports per message size the time, the algorithm bandwidth
``algbw = S / t`` and the bus bandwidth ``busbw = algbw * factor(n)``, which is comparable to
the hardware's link speed whatever the rank count: all_reduce 2(n-1)/n, all_gather and
alltoall (n-1)/n (S = the whole gathered or exchanged buffer), sendrecv 1. Both sources of
numbers, the nccl-tests parser (nccl_tests.py) and the built-in torch benchmark (bench.py),
produce a :class:`CollectiveResult`, so one :func:`evaluate` judges both.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from workers.preflight.limits import BUSBW_FACTOR, COLLECTIVES, Finding  # noqa: F401  (re-exported)



def busbw(collective: str, algbw: float, num_ranks: int) -> float:
    return algbw * BUSBW_FACTOR[collective](num_ranks)


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


@dataclasses.dataclass
class Measurement:
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: Optional[int]
    """Elements that differed from the expected result; None when not validated (``N/A``)."""


@dataclasses.dataclass
class SizeRow:
    """One line of an nccl-tests table."""

    size_bytes: int
    count: int
    dtype: str
    redop: str
    root: int
    out_of_place: Measurement
    in_place: Optional[Measurement] = None

    @property
    def best_busbw(self) -> float:
        return max(m.busbw_gbps for m in (self.out_of_place, self.in_place) if m is not None)


@dataclasses.dataclass
class CollectiveResult:
    collective: str
    tool: str
    """``nccl-tests``, ``torch-nccl`` or ``torch-gloo``."""
    num_ranks: int
    rows: list[SizeRow] = dataclasses.field(default_factory=list)
    avg_busbw_gbps: Optional[float] = None
    """nccl-tests' closing "Avg bus bandwidth" line (mean over sizes)."""
    complete: bool = True
    """False when the output stopped before the table's end (a killed or crashed test)."""
    out_of_bounds: Optional[int] = None
    """nccl-tests' "Out of bounds values" count (0 when OK)."""
    error: Optional[str] = None
    skipped: Optional[str] = None
    """Why the collective was not measured although nothing failed (sendrecv with 1 rank)."""
    command: Optional[list[str]] = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CollectiveResult":
        rows = [SizeRow(**{**r, "out_of_place": Measurement(**r["out_of_place"]),
                           "in_place": Measurement(**r["in_place"]) if r.get("in_place") else None})
                for r in d.get("rows", [])]
        return cls(**{**d, "rows": rows})

    def headline(self) -> str:
        """``all_reduce: busbw 452.10 GB/s at 1 GiB (nccl-tests, 16 ranks)``."""
        if self.error:
            return f"{self.collective}: error ({self.tool}): {self.error}"
        if self.skipped:
            return f"{self.collective}: skipped ({self.tool}): {self.skipped}"
        if not self.rows:
            return f"{self.collective}: no measurements ({self.tool})"
        top = self.rows[-1]
        return (f"{self.collective}: busbw {top.best_busbw:.2f} GB/s at {human_bytes(top.size_bytes)} "
                f"({self.tool}, {self.num_ranks} ranks)")


def evaluate(result: CollectiveResult, *, where: str, thresholds: dict[str, float], threshold_key: str) -> list[Finding]:
    """Findings for one result: failures to run, truncation, wrong elements, busbw under its threshold.

    The threshold applies to the largest size measured (best of out-of-place and in-place):
    small messages measure latency, not links.
    """
    c = result.collective

    def fail(check: str, message: str) -> Finding:
        return Finding("fail", check, where, None, f"{c} ({result.tool}): {message}")

    if result.error:
        return [fail("benchmark", result.error)]
    if result.skipped:
        return []
    out = []
    if not result.complete:
        out.append(fail("truncated", f"output ends after {len(result.rows)} row(s), before nccl-tests' closing "
                                     f"'# Avg bus bandwidth' line: the test was killed or crashed"))
    for row in result.rows:
        for label, m in (("out-of-place", row.out_of_place), ("in-place", row.in_place)):
            if m is not None and m.wrong:
                out.append(fail("wrong", f"{m.wrong} wrong element(s) at {human_bytes(row.size_bytes)} ({label}): "
                                         f"data corruption on a GPU or link"))
    if result.out_of_bounds:
        out.append(fail("wrong", f"{result.out_of_bounds} out-of-bounds values"))
    limit = thresholds.get(c)
    if not result.rows:
        if result.complete:
            out.append(fail("benchmark", "no measurements"))
        return out
    if limit and result.num_ranks < 2:
        out.append(Finding("warn", "busbw", where, None, f"{c}: 1 rank, bandwidth not judged against "
                                                         f"{threshold_key}.{c}({limit:g})"))
    elif limit:
        top = result.rows[-1]
        if top.best_busbw < limit:
            out.append(fail("busbw", f"busbw {top.best_busbw:.2f} GB/s at {human_bytes(top.size_bytes)} < "
                                     f"{threshold_key}.{c}({limit:g}) over {result.num_ranks} ranks"))
    return out
