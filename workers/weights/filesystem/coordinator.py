"""Filesystem transport, orchestrator side: move every live worker to the newest STABLE step.

Each loop turn: the newest ``weights/step_V`` with STABLE, if V is newer than what the
workers serve -> pause -> ``/update_weights_from_disk`` model_path=weights/step_V,
weight_version=V on every live worker -> continue (workers/weights/coordinator.py) ->
with ``weights.verify``, compare each worker's digest with index.json's. A refusal keeps
the old version; the next turn retries the newest step (health-checking first, so a dead
worker cannot hold the version back). Protocol: the package docstring.
"""
from __future__ import annotations

import asyncio
from typing import Any, Sequence

from workers.common.protocol import latest_stable_step
from workers.weights.coordinator import WeightCoordinator, WeightSwap, WeightUpdateError, swap_weights
from workers.weights.filesystem.layout import index_digest


async def update_all_workers(clients: Sequence[Any], model_path: str, version: int) -> WeightSwap:
    """pause(in_place) -> load ``model_path`` from disk -> continue on every worker."""
    return await swap_weights(clients, version, lambda c: c.update_weights_from_disk(model_path, version))


class FilesystemCoordinator(WeightCoordinator):
    async def maybe_update(self, pool: Any) -> None:
        newest = latest_stable_step(self.paths.root / "weights")
        if newest is None or newest <= self.version:
            return
        try:
            live = pool.live_clients()
            swap = await update_all_workers(live, str(self.paths.weights(newest)), newest)
            self.update_s, self.version = swap.seconds, newest
            if self.cfg.weights.verify:
                expected = await asyncio.to_thread(index_digest, self.paths.weights(newest))
                self.verify(newest, live, swap.digests, expected)
        except WeightUpdateError as e:  # keep serving old weights; the next poll retries the newest step
            self.log.warning("%s", e)
            await pool.check_live()  # a dead worker must not hold the version back
