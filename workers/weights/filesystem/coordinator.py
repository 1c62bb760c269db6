"""Filesystem transport, orchestrator side: move every live worker to the newest STABLE step.

Each loop turn: the newest ``weights/step_V`` with STABLE, if V is newer than what the
workers serve -> pause -> ``/update_weights_from_disk`` model_path=weights/step_V,
weight_version=V on every live worker -> continue (workers/weights/coordinator.py; embedded
engines are not paused: they stage the step while generating and swap it in between steps) ->
with ``weights.verify``, compare each worker's digest with index.json's. A refusal keeps
the old version (health-checking first, so a dead worker cannot hold the version back): a
version refused for its content (400: checksum, NaN, malformed) is never tried again, the
newest intact one below it is, and with ``weights.delta`` the trainer is asked for a full step at
once (reanchor.py); a refused step written again since is tried again. Any other failure retries
after a backoff (0.5 s doubling to 30 s: workers/weights/coordinator.RetryPolicy). Protocol: the
package docstring.
"""
from __future__ import annotations

import asyncio
from typing import Any, Sequence

from workers.weights.coordinator import WeightCoordinator, WeightSwap, WeightUpdateError, slowest_parts, swap_weights
from workers.weights.filesystem.layout import index_digest, stable_versions
from workers.weights.filesystem.reanchor import Reanchor


async def update_all_workers(clients: Sequence[Any], model_path: str, version: int, gone=None, *,
                             pause: bool = True) -> WeightSwap:
    """pause(in_place) -> load ``model_path`` from disk -> continue on every worker (``gone``, ``pause``:
    swap_weights)."""
    return await swap_weights(clients, version, lambda c: c.update_weights_from_disk(model_path, version), gone=gone,
                              pause=pause)


class FilesystemCoordinator(WeightCoordinator):
    def __init__(self, cfg: Any, paths: Any, *, log: Any):
        super().__init__(cfg, paths, log=log)
        # embedded engines stage a step while they generate and swap it in between decode steps (no pause)
        self.pauses_generation = cfg.inference.backend != "embedded"
        self.reanchor = Reanchor(paths.root / "weights", self.retry, enabled=bool(getattr(cfg.weights, "delta", False)),
                                 log=log)

    async def maybe_update(self, pool: Any) -> None:
        """One try per loop turn: the newest published version above ours that no worker refused
        for its content and whose backoff is over (``self.retry``); a refused newest step falls
        back to the newest intact one in between."""
        self.reanchor.forget_rewritten()
        newer = [v for v in stable_versions(self.paths.root / "weights") if v > self.version]
        untried = [v for v in newer if v not in self.retry.refused]
        if not untried or not self.retry.due(untried[0], context=tuple(pool.live())):
            return
        newest = untried[0]
        self.reanchor.trying(newest)
        before = await asyncio.to_thread(index_digest, self.paths.weights(newest)) if self.reanchor.enabled else None
        try:
            live = pool.live_clients()
            swap = await update_all_workers(live, str(self.paths.weights(newest)), newest,
                                            gone=getattr(pool, "gone", None), pause=self.pauses_generation)
            self.update_s, self.version = swap.seconds, newest
            self.engine_timing = slowest_parts(swap.answers)
            self.retry.succeeded(newest)
            if swap.left:
                self.log.warning("weights v%d: left %s behind (marked dead during the update; it loads the current "
                                 "weights when it comes back)", newest, ", ".join(c.base_url for c in swap.left))
            if self.cfg.weights.verify:
                expected = await asyncio.to_thread(index_digest, self.paths.weights(newest))
                kept = [(c, d) for c, d in zip(live, swap.digests) if c not in swap.left]
                if before is not None and any(d != expected for _, d in kept):
                    expected = before  # written again (a full step) while the workers read the patch step
                self.verify(newest, [c for c, _ in kept], [d for _, d in kept], expected)
        except WeightUpdateError as e:  # keep serving old weights
            wait = self.retry.failed(newest, content=e.content, context=tuple(pool.live()))
            if e.content:
                self.refused += 1
                self.reanchor.refused(newest, str(e))
            self.log.warning("%s; %s", e, f"v{newest} is not tried again unless it is written again (refused for its content)"
                             if e.content else f"retrying v{newest} in {wait:.1f}s")
            await pool.check_live()  # a dead worker must not hold the version back


def make_coordinator(cfg: Any, paths: Any, *, log: Any) -> WeightCoordinator:
    """TransportSpec.coordinator: full steps from disk; with ``weights.delta`` into SGLang servers, patch steps
    pulled per rank by our custom weight loader (workers/weights/sglang/pull_coordinator.py: SGLang cannot load a patch step)."""
    from workers.common.registry import speaks_sglang

    if getattr(cfg.weights, "delta", False) and speaks_sglang(cfg):
        from workers.weights.sglang.pull_coordinator import FilesystemSGLangCoordinator

        return FilesystemSGLangCoordinator(cfg, paths, log=log)
    return FilesystemCoordinator(cfg, paths, log=log)
