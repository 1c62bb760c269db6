"""Python's garbage collector in a long-lived role: freeze what start-up built, measure every pause.

Why: a full (generation 2) collection walks every object the collector tracks, and while it runs
every thread of the process waits on the GIL: the engine's decode loop and its weight update, the
orchestrator's loop, the trainer between kernels. After start-up a role holds most of its objects
for good: importing torch and transformers and building a SmolLM2-135M model tracks ~360k objects,
and one full collection of them took 0.16 s on a 2-core CI machine; on an H100 host the quickstart's
roles held 300-450k (0.15-0.22 s each), longer than a step of the model they serve. Such a collection
comes whenever enough objects outlive the younger generations, so it lands at random inside a
weight update, a decode block or a training step (issue 45's loop). With the freeze, the H100 run's
engine and orchestrator paused at most 4-5 ms; the trainer freezes a second time after its first
step, whose compilation leaves ~190k more objects for good.

:func:`settle` runs once, at the end of a role's start-up: one collection, then ``gc.freeze()``
moves every surviving object into the permanent generation, which later collections skip. Only
cyclic garbage made of start-up objects is left uncollected (reference counting still frees the rest),
a fair price for a process whose start-up state lives as long as it does.

:func:`pauses` reports what the collector cost since (``gc_pause_s_total``, ``gc_pause_max_s``,
``gc_full_collections``); the roles' heartbeats add it to their metrics (workers/common/heartbeat.py).
"""
from __future__ import annotations

import gc
import threading
import time
from typing import Any, Optional


class GcPauses:
    """A ``gc.callbacks`` entry: sums the wall time of every collection of this process."""

    def __init__(self) -> None:
        self.total_s = self.max_s = 0.0
        self.count = self.full = 0
        self._start: dict[int, float] = {}  # per thread: a collection runs in the thread that triggered it

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        tid = threading.get_ident()
        if phase == "start":
            self._start[tid] = time.perf_counter()
            return
        t0 = self._start.pop(tid, None)
        if t0 is None:
            return
        dt = time.perf_counter() - t0
        self.total_s += dt
        self.max_s = max(self.max_s, dt)
        self.count += 1
        if info.get("generation") == 2:
            self.full += 1

    def sample(self) -> dict[str, float]:
        return {"gc_pause_s_total": round(self.total_s, 4), "gc_pause_max_s": round(self.max_s, 4),
                "gc_full_collections": float(self.full)}


_WATCH: Optional[GcPauses] = None


def settle(log: Any = None, *, role: str = "") -> GcPauses:
    """End of a role's start-up: collect once, freeze the survivors, start measuring pauses (idempotent:
    a second call freezes what was built since and keeps the same measurements)."""
    global _WATCH
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    took = time.perf_counter() - t0
    if _WATCH is None:
        _WATCH = GcPauses()
        gc.callbacks.append(_WATCH)
    if log is not None:
        log.info("%sgarbage collector: %d start-up objects frozen (one full collection took %.3f s; later ones "
                 "skip them)", f"{role}: " if role else "", gc.get_freeze_count(), took)
    return _WATCH


def pauses() -> dict[str, float]:
    """What the collector cost since :func:`settle` ({} before it, or in a process that never called it)."""
    return _WATCH.sample() if _WATCH is not None else {}


def reset_for_tests() -> None:
    """Undo :func:`settle` (tests run it inside pytest's own process)."""
    global _WATCH
    if _WATCH is not None and _WATCH in gc.callbacks:
        gc.callbacks.remove(_WATCH)
    _WATCH = None
    gc.unfreeze()
