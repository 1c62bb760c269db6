"""The orchestrator's weight update beside its loop (workers/orchestrator/weight_updates.py, issue 45).

An update an embedded engine generates through runs as a task: while it is in flight each loop
turn goes on (poll returns None at once, no second update starts), and the turn after it ended
reports it (with its error, if it failed). A transport that pauses its workers keeps the update
inline: the turn waits for it.
"""
from __future__ import annotations

import asyncio

import pytest

from workers.orchestrator.rollouts import BusyMeter
from workers.orchestrator.weight_updates import UpdateRunner


class HeldCoordinator:
    """maybe_update holds until ``release`` is set (a slow load), then moves to the next version."""

    def __init__(self, *, fail: bool = False, hold: bool = True):
        self.version, self.calls, self.fail, self.hold = 0, 0, fail, hold
        self.release = asyncio.Event()

    async def maybe_update(self, pool) -> None:
        self.calls += 1
        if self.hold:
            await self.release.wait()
        if self.fail:
            raise RuntimeError("worker refused the step")
        self.version += 1


def test_beside_the_loop_each_turn_goes_on_until_the_update_ends():
    async def main():
        weights = HeldCoordinator()
        runner = UpdateRunner(weights, concurrent=True)
        assert await runner.poll(None, BusyMeter()) is None  # started, still loading
        for _ in range(3):  # later turns: no second update, no wait
            assert await asyncio.wait_for(runner.poll(None, BusyMeter()), 0.5) is None
        assert weights.calls == 1 and weights.version == 0
        weights.release.set()
        await runner.wait()
        ended = await runner.poll(None, BusyMeter())
        assert ended is not None and weights.version == 1 and runner.task is None

    asyncio.run(main())


def test_a_poll_that_finds_nothing_new_ends_in_its_own_turn():
    async def main():
        weights = HeldCoordinator(hold=False)
        runner = UpdateRunner(weights, concurrent=True)
        assert await runner.poll(None, BusyMeter()) is not None and runner.task is None

    asyncio.run(main())


def test_an_update_that_failed_beside_the_loop_raises_in_the_turn_that_reports_it():
    async def main():
        weights = HeldCoordinator(fail=True)
        runner = UpdateRunner(weights, concurrent=True)
        assert await runner.poll(None, BusyMeter()) is None
        weights.release.set()
        await runner.wait()
        with pytest.raises(RuntimeError, match="refused"):
            await runner.poll(None, BusyMeter())
        assert runner.task is None

    asyncio.run(main())


def test_a_pausing_transport_updates_inline():
    async def main():
        weights = HeldCoordinator()
        runner = UpdateRunner(weights, concurrent=False)
        turn = asyncio.create_task(runner.poll(None, BusyMeter()))
        await asyncio.sleep(0.05)
        assert not turn.done(), "the turn waits for a pausing transport's update"
        weights.release.set()
        assert await asyncio.wait_for(turn, 1.0) is not None and weights.version == 1

    asyncio.run(main())
