"""The loop's per-step timeline: wall-clock marks of every role, one JSON line per role per step.

Why: a step interval above the slower of the trainer and generation is loop overhead (a poll
that sleeps, a pause for weights, a batch that waits on disk), and none of the per-step metrics
says where it went: each role only sees its own side. Each role appends marks (``time.time()``,
one host's clock on the local path) to its own file under ``RUN/timeline/`` -- one writer per
file, so appends never interleave, also on NFS -- and ``launcher/timeline.py`` joins them by step
into phases and one summary line (``slurmrl status RUN`` prints it; the launcher prints it when a
local run ends).

Records (``step`` N: trainer step N, batch N, weights ``step_N``):

- ``orchestrator.jsonl``, ``kind: batch``: ``first_group_done`` / ``last_group_done`` (when the
  batch's first and last prompt group finished: generation and reward done), ``write_start`` /
  ``batch_written`` (the batch on disk with READY), ``generation_s`` (see below), ``reward_s``
  (the slowest env step time among the batch's samples: scoring), ``groups``.
- ``orchestrator.jsonl``, ``kind: apply``: ``start`` / ``end`` of the swap that moved the engines
  to weights ``step`` (pause -> load -> verify -> continue; ``end`` is when generation resumed;
  embedded engines are not paused: they generate through the load and swap between decode steps).
- ``trainer.jsonl``, ``kind: step``: ``wait_start``, ``batch_ready`` (wait_for_batch returned),
  ``loaded`` (batch in device memory, every rank), ``trained`` (train_step returned),
  ``published`` (publish_weights returned).

``generation_s`` of batch N is the inference busy time (workers/orchestrator/rollouts.BusyMeter:
wall time with at least one generate request outstanding) between batch N-1's write and batch
N's, minus the part of it spent paused for weight updates (requests paused in place stay
outstanding, but nothing is generated). In steady state the engine does one batch's worth of
generation per batch interval, so it is the generation time a batch costs; an engine that idles
(waiting for weights, or held back by the staleness window) adds nothing to it. Requests for
later batches that run meanwhile count where they run: the sum over a run is the whole busy time.

Torch-free (the orchestrator never imports torch; the launcher reads these files).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional

TIMELINE_DIR = "timeline"
ROLES = ("orchestrator", "trainer")


def timeline_file(run_dir: str | os.PathLike, role: str) -> Path:
    if role not in ROLES:
        raise ValueError(f"timeline role {role!r} is not one of {ROLES}")
    return Path(run_dir) / TIMELINE_DIR / f"{role}.jsonl"


class TimelineWriter:
    """Appends one role's records (a line each, flushed: a killed role loses at most the step it was in).

    Never raises on a write error: the timeline is evidence about the run, never a reason to stop it
    (the first error is logged through ``log`` when given, later ones are dropped)."""

    def __init__(self, run_dir: str | os.PathLike, role: str, *, log: Any = None):
        self.path, self.log, self.failed = timeline_file(run_dir, role), log, False
        self._f = None

    def write(self, kind: str, step: int, **marks: Optional[float]) -> None:
        if self.failed:
            return
        record = {"kind": kind, "step": int(step), **{k: (round(v, 6) if isinstance(v, float) else v)
                                                      for k, v in marks.items()}}
        try:
            if self._f is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._f = open(self.path, "a", buffering=1)
            self._f.write(json.dumps(record) + "\n")
        except OSError as e:
            self.failed = True
            if self.log is not None:
                self.log.warning("timeline: cannot write %s (%s); no more timeline records from this role", self.path, e)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def now() -> float:
    """The timeline's clock: wall time (both roles of a local run share it; across hosts NTP's accuracy)."""
    return time.time()


def read_timeline(run_dir: str | os.PathLike) -> dict[tuple[str, str], dict[int, dict]]:
    """``{(role, kind): {step: record}}``; a step recorded twice (a restarted role) keeps its last record.
    Lines that do not parse (a role killed mid-write) are skipped."""
    out: dict[tuple[str, str], dict[int, dict]] = {}
    for role in ROLES:
        path = timeline_file(run_dir, role)
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
                out.setdefault((role, rec["kind"]), {})[int(rec["step"])] = rec
            except (ValueError, KeyError, TypeError):
                continue
    return out
