"""Hung inference workers: marked dead by the orchestrator, yet their process still runs.

A worker that stops answering (SIGSTOP, a wedged GPU, a deadlock) without exiting is never
restarted by an exit-watching supervisor: it holds its node (or its slots) and the run goes on
one worker short for good. The orchestrator lists the workers it marked dead, since when
(wall time) and the kill bound (``launcher.hung_worker_kill_s``) in
``run_dir/inference_health.json`` (workers/orchestrator/faults.py); both supervisors read it
with :func:`hung_workers` and kill such a process (the local backend by PID, the Slurm
supervisor its srun step), after which the usual restart path starts it again.

Only a process that answered the orchestrator after it started (``last_ok``, the worker's last
good answer) is killed: its replacement, still loading, is left alone even when the orchestrator
marks that worker dead only after the replacement started (the old process died with a step that
held several workers; the misses add up while the new one loads). A replacement that answers and
then hangs is killed like the first. Standard library only (the Slurm supervisor runs it on the
batch node).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Mapping, Optional, Union

from workers.common.protocol import INFERENCE_HEALTH


class _Every(dict):
    """Every worker index maps to the same start time."""

    def __init__(self, t: float):
        super().__init__()
        self.t = t

    def __contains__(self, key) -> bool:
        return True

    def __getitem__(self, key) -> float:
        return self.t


def read_health(run_dir: Path) -> dict:
    """The orchestrator's health file ({} when absent or torn)."""
    try:
        body = json.loads((Path(run_dir) / INFERENCE_HEALTH).read_text())
    except (OSError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def hung_workers(run_dir: Path, started: Union[Mapping[int, float], float], *, now: Optional[float] = None,
                 kill_after_s: Optional[float] = None) -> dict[int, float]:
    """{worker: seconds dead} for the workers of ``started`` ({worker index: wall time its running
    process started}; one number: every worker, the start of the one Slurm step that holds them all)
    that the orchestrator marked dead more than the bound ago and that answered after that process
    started (``last_ok``; a file without it: ``since``).
    ``kill_after_s``: the bound (None: the one the orchestrator wrote; 0: never)."""
    if not isinstance(started, Mapping):
        started = _Every(float(started))
    body = read_health(run_dir)
    bound = body.get("kill_after_s", 0) if kill_after_s is None else kill_after_s
    if not isinstance(bound, (int, float)) or bound <= 0:
        return {}
    now = time.time() if now is None else now
    out = {}
    for key, info in (body.get("dead") or {}).items():
        try:
            w, since = int(key), float(info["since"])
            last_ok = float(info.get("last_ok", since))
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
        if w in started and started[w] < last_ok and now - since > bound:  # last_ok <= since
            out[w] = now - since
    return out
