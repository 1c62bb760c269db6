"""Rollout mechanics: the inference busy meter (prompt groups run through episodes.py, for every env).

Weight updates (the only sync point between inference and training) are the transport's
coordinator's job: workers/weights/coordinator.py (pause -> load or send -> verify ->
continue) and workers/weights/<transport>/coordinator.py.
Requests that spanned an update carry per-token versions, so staleness stays exact.
"""
from __future__ import annotations

import time



class BusyMeter:
    """Wall time during which at least one generate request is outstanding (inference busy)."""

    def __init__(self):
        self.active, self.busy_s, self.since = 0, 0.0, time.monotonic()
        self.env_wait_s = 0.0

    def enter(self) -> None:
        if self.active == 0:
            self.since = time.monotonic()
        self.active += 1

    def exit(self) -> None:
        self.active -= 1
        if self.active == 0:
            self.busy_s += time.monotonic() - self.since

    def busy_total(self) -> float:
        return self.busy_s + (time.monotonic() - self.since if self.active else 0.0)


