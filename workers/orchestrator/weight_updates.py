"""When the orchestrator's loop runs the transport's weight update: inline, or beside the loop.

Why: the update (pause -> load or send -> verify -> continue, workers/weights/<transport>/coordinator.py)
takes a small model's step ~0.15 s on one GPU (the engine reads the published step, stages it beside
the live weights and swaps between decode blocks). Awaited inline, it held the whole loop: finished
groups were not collected, the next batch was not written (so the trainer waited) and no group was
launched, although an embedded engine generates through its update (workers/inference/embedded/
weight_swap.py). On the one-GPU quickstart with SmolLM2-135M that was most of what kept the step
interval above the slower of the trainer and generation (issue 45: interval 0.37 s, bound 0.24 s,
``apply`` 0.15 s).

So for transports that do not pause generation (``pauses_generation`` False: the embedded engines)
and no LoRA coordinator (whose worker checks must see one version at a time), the update runs as a
task: the loop keeps collecting, writing batches and launching groups at the version it had
(launch windows and group tags use ``Orchestrator.version``, which changes only when the update
ended; every token still carries the version it was sampled with). A transport that pauses its
workers (SGLang) keeps the inline update: requests sent to a paused server would wait anyway.
"""
from __future__ import annotations

import asyncio
from typing import Optional

from workers.common.timeline import now


class UpdateRunner:
    """Runs ``weights.maybe_update(pool)`` per loop turn; :meth:`poll` says when one has ended."""

    def __init__(self, weights, *, concurrent: bool):
        self.weights, self.concurrent = weights, concurrent
        self.task: Optional[asyncio.Task] = None
        self.started: tuple[float, float] = (0.0, 0.0)

    async def poll(self, pool, meter) -> Optional[tuple[float, float]]:
        """``(start time, generation busy seconds at start)`` of an update attempt that ended in this
        call (it may have found nothing new), None while one runs beside the loop. Its error, if any,
        is raised here."""
        if self.task is None:
            self.started = (now(), meter.busy_total())
            if not self.concurrent:
                await self.weights.maybe_update(pool)
                return self.started
            self.task = asyncio.create_task(self.weights.maybe_update(pool))
            await asyncio.sleep(0)  # a poll that finds nothing new usually ends here
        if not self.task.done():
            return None
        task, self.task = self.task, None
        await task
        return self.started

    async def wait(self) -> None:
        """Until the update running beside the loop (if any) has ended; :meth:`poll` then reports it."""
        if self.task is not None:
            await asyncio.wait({self.task})

    def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
