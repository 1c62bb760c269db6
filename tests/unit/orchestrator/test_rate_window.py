"""``inference_tokens_per_s`` counts from the first request, not from the orchestrator's start
(workers/orchestrator/rollouts.RateWindow): a steady engine reads steady from its first batch."""
from __future__ import annotations

import pytest

from workers.orchestrator.rollouts import RateWindow


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_steady_rate_from_the_first_request():
    clock = Clock(100.0)  # the servers took 100 s to become ready
    w = RateWindow(window_s=10.0, clock=clock)
    assert w.rate() == 0.0
    w.start()
    rates = []
    for _ in range(6):  # 500 tokens per second, a group a second
        clock.t += 1.0
        w.add(500)
        rates.append(w.rate())
    assert rates == pytest.approx([500.0] * 6)  # was 50, 100, 150 ... (over a 10 s window nobody filled)


def test_window_slides_and_start_is_once():
    clock = Clock(0.0)
    w = RateWindow(window_s=10.0, clock=clock)
    w.start()
    for _ in range(30):
        clock.t += 1.0
        w.add(100)
        w.start()  # every later launch: no effect
    assert w.rate() == pytest.approx(100 * 11 / 10.0)  # completions at t=20..30 inclusive, over the 10 s window
    clock.t += 60.0
    assert w.rate() == 0.0  # nothing finished in the window
