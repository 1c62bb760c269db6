"""Rollout mechanics: the inference busy meter (prompt groups run through episodes.py, for every env).

Weight updates (the only sync point between inference and training) are the transport's
coordinator's job: workers/weights/coordinator.py (pause -> load or send -> verify ->
continue) and workers/weights/<transport>/coordinator.py.
Requests that spanned an update carry per-token versions, so staleness stays exact.
"""
from __future__ import annotations

import time
from collections import deque


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



class RateWindow:
    """Completion tokens per second over the last ``window_s``, counted from when generation started.

    Why not from the orchestrator's start: the servers take a while to become ready (model load,
    CUDA graphs), and a window that reaches back before the first request divides the first
    seconds' tokens by time nobody generated in (the progress line ramped 179, 358, 538 ... tok/s
    on a steady engine). :meth:`start` marks the first request launched after readiness."""

    def __init__(self, window_s: float = 10.0, clock=time.monotonic):
        self.window_s, self.clock = window_s, clock
        self.started_at: float | None = None
        self.completions: deque[tuple[float, int]] = deque()  # (time, tokens) of finished groups

    def start(self) -> None:
        if self.started_at is None:
            self.started_at = self.clock()

    def add(self, tokens: int) -> None:
        self.completions.append((self.clock(), tokens))

    def rate(self) -> float:
        now = self.clock()
        while self.completions and self.completions[0][0] < now - self.window_s:
            self.completions.popleft()
        if not self.completions or self.started_at is None:
            return 0.0
        covered = min(self.window_s, now - self.started_at)  # generation ran this long within the window
        return sum(n for _, n in self.completions) / max(covered, 1e-3)
