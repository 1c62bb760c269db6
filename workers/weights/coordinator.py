"""The orchestrator's side of every transport: pause -> load or send -> verify -> continue.

The orchestrator drives weight updates; workers obey. Each transport's ``coordinator.py``
subclasses :class:`WeightCoordinator` and decides *when* there is a newer version and *how*
a worker gets it (its own protocol, in the transport package's docstring); the sequence
around it is shared (:func:`swap_weights`):

  1. ``/pause_generation`` mode=in_place on EVERY worker (in-flight requests keep their KV
     cache and wait; nothing is aborted),
  2. the transport's load step on every worker at once (each verifies what it got and, on
     refusal, keeps its old weights),
  3. ``/continue_generation`` on every worker that paused, also when step 2 failed
     somewhere (a bad update never freezes inference).

Requests that spanned the update carry per-token versions, so staleness stays exact. Every
call has the client's timeout; failures carry the worker URL and response text and end in
:class:`WeightUpdateError` (the orchestrator logs it and goes on with the old version).
Verify (:meth:`WeightCoordinator.verify`): an update counts as verified when every worker's
reported ``weights_digest`` equals the trainer's (workers/weights/digest.py).

Torch-free: the orchestrator never imports torch.
"""
from __future__ import annotations

import abc
import asyncio
import dataclasses
import time
from typing import Any, Callable, Optional, Sequence


class WeightUpdateError(RuntimeError):
    """At least one worker refused or failed a weight update."""


@dataclasses.dataclass
class WeightSwap:
    seconds: float
    """pause -> load -> continue, as the orchestrator waited for it."""
    digests: list[Optional[str]]
    """Per worker, the ``weights_digest`` it reported after applying (None: not reported)."""


async def swap_weights(clients: Sequence[Any], version: int, load: Callable[[Any], Any],
                       before: Optional[Callable[[], None]] = None) -> WeightSwap:
    """pause(in_place) -> ``before()`` -> ``load(client)`` on every client at once -> continue.

    ``clients`` are workers.common.inference_client.InferenceClient; ``load`` returns the
    coroutine of the transport's admin call (its answer: ``{success, weights_digest?}``).
    """
    t0 = time.perf_counter()
    paused = await asyncio.gather(*(c.pause_generation(mode="in_place") for c in clients), return_exceptions=True)
    try:
        if before is not None:
            before()
        results = await asyncio.gather(*(load(c) for c in clients), return_exceptions=True)
    finally:  # a worker that paused must continue, whatever happened to the others
        await asyncio.gather(*(c.continue_generation() for c, p in zip(clients, paused)
                               if not isinstance(p, BaseException)), return_exceptions=True)
    failures = [f"{c.base_url}: {p if isinstance(p, BaseException) else r}" for c, p, r in zip(clients, paused, results)
                if isinstance(p, BaseException) or isinstance(r, BaseException) or not r.get("success", False)]
    if failures:
        raise WeightUpdateError(f"weight update to version {version} failed on {len(failures)} worker(s): "
                                + "; ".join(failures))
    return WeightSwap(time.perf_counter() - t0, [r.get("weights_digest") for r in results])


class WeightCoordinator(abc.ABC):
    """One run's orchestrator side of a transport.

    ``pool`` (workers/orchestrator/faults.WorkerPool) offers ``clients`` (every server),
    ``live_clients()`` and ``await check_live()``; the coordinator keeps ``version`` (what
    every updated worker serves), ``update_s`` (the last swap's time) and the verify counts,
    which the orchestrator copies into each batch's metrics.
    """

    def __init__(self, cfg: Any, paths: Any, *, log: Any):
        self.cfg, self.paths, self.log = cfg, paths, log
        self.version = 0
        self.update_s: Optional[float] = None
        self.verified = self.mismatched = 0  # updates checked end to end (weights.verify)
        self.fallbacks = 0  # updates that went through the filesystem after the transport's own path failed

    async def start(self, clients: Sequence[Any]) -> None:
        """Once every worker is ready, before the first rollout (the broadcast group forms here)."""

    async def revive(self, pool: Any, worker: int, current: Callable[[], tuple[int, Optional[str]]]) -> bool:
        """Dead ``worker`` may answer again: bring it to the current weights and readmit it
        (workers/orchestrator/faults.py). Default: load ``current()``'s published step from disk."""
        return await pool.try_revive(worker, current)

    @abc.abstractmethod
    async def maybe_update(self, pool: Any) -> None:
        """If the trainer published a newer version: pause -> load or send -> verify -> continue.
        A refusal is logged and the old version kept (never raises WeightUpdateError)."""

    def verify(self, version: int, clients: Sequence[Any], digests: Sequence[Optional[str]],
               expected: Optional[str]) -> None:
        """Count an update as verified when every worker's weights digest equals the trainer's."""
        if expected is None or None in digests or self.cfg.trainer.dtype != self.cfg.inference.dtype:
            return  # nothing to compare (SGLang workers, weights.verify off, or a dtype cast on the way)
        bad = [c.base_url for c, d in zip(clients, digests) if d != expected]
        if bad:
            self.mismatched += 1
            self.log.error("weights v%d on %s differ from the trainer's (digest %s): not bit-identical", version,
                           ", ".join(bad), expected)
        else:
            self.verified += 1
