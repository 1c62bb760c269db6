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

Embedded engines are not paused by the filesystem transport: each stages the update while it
generates and swaps it in between two decode steps (workers/inference/embedded/weight_swap.py), so
generation stops for the swap alone (``swap_weights(pause=False)``).

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

from workers.common.dtypes import held_dtype


def receiver_rank_counts(cfg) -> list[int]:
    """Group ranks per inference server (RunConfig ``cfg``), in the order of inference_urls: a broadcast
    group's receivers, and the custom weight loader's verdicts per SGLang server (one per TP rank).

    Unified workers, or prefill servers then decode servers; each contributes its TP size
    (the embedded engine: 1).
    """
    i = cfg.inference
    if i.num_workers:
        return [i.worker.tp] * i.num_workers
    return [i.prefill.tp] * i.num_prefill_replicas + [i.decode.tp] * i.num_decode_replicas


class WeightUpdateError(RuntimeError):
    """At least one worker refused or failed a weight update.

    ``content``: every failing worker answered and refused the update itself (HTTP 400, or a
    ``success: false`` answer: a checksum, NaN, a malformed step): trying the same version again
    cannot succeed. False when some worker gave no answer or a server error (it may recover)."""

    def __init__(self, message: str, *, content: bool = False):
        super().__init__(message)
        self.content = content


class RetryPolicy:
    """When a coordinator may try a failed version again (a retry storm otherwise: every loop
    turn paused generation and re-read and re-hashed the whole step on every worker).

    A version refused for its content is never tried again (a newer one is tried at once); after
    any other failure the same version waits ``first_s``, then twice as long each time, up to
    ``max_s``. A success, a newer version or another ``context`` (the live workers: one marked
    dead no longer holds the update back) starts afresh."""

    def __init__(self, *, first_s: float = 0.5, max_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.first_s, self.max_s, self.clock = first_s, max_s, clock
        self.refused: set[int] = set()
        self.version: Optional[int] = None  # the version the backoff below belongs to
        self.context: Any = None
        self.failures = 0
        self.next_try = 0.0

    def due(self, version: int, context: Any = None) -> bool:
        if version in self.refused:
            return False
        return version != self.version or context != self.context or self.clock() >= self.next_try

    def failed(self, version: int, *, content: bool, context: Any = None) -> float:
        """Record a failed try; returns the seconds until ``version`` may be tried again (inf: never)."""
        if content:
            self.refused.add(version)
            return float("inf")
        self.failures = self.failures + 1 if (version, context) == (self.version, self.context) else 1
        self.version, self.context = version, context
        wait = min(self.max_s, self.first_s * 2 ** (self.failures - 1))
        self.next_try = self.clock() + wait
        return wait

    def succeeded(self, version: int) -> None:
        self.version, self.failures, self.next_try = None, 0, 0.0


@dataclasses.dataclass
class WeightSwap:
    seconds: float
    """pause -> load -> continue, as the orchestrator waited for it."""
    digests: list[Optional[str]]
    """Per worker, the ``weights_digest`` it reported after applying (None: not reported)."""
    left: list[Any] = dataclasses.field(default_factory=list)
    """Workers marked dead while the swap waited on them: left behind (they load when they come back)."""
    answers: list[Optional[dict]] = dataclasses.field(default_factory=list)
    """Per worker, its whole answer (None: left behind); LoRA mode reads ``adapter_digest`` from it."""


def slowest_parts(answers: Sequence[Optional[dict]]) -> dict[str, float]:
    """Per part of an engine's update (``update_timing`` in its answer: read, stage, lock_wait, swap,
    total seconds; workers/inference/embedded/weight_swap.py), the slowest worker's; {} when none says."""
    out: dict[str, float] = {}
    for a in answers:
        timing = a.get("update_timing") if isinstance(a, dict) else None
        if isinstance(timing, dict):
            for k, v in timing.items():
                if isinstance(v, (int, float)):
                    out[k] = max(out.get(k, 0.0), float(v))
    return out


class WorkerLeft(Exception):
    """The worker was marked dead while a swap waited on it (``gone`` was set)."""


async def _unless_gone(aw: Any, gone: Optional[asyncio.Event]) -> Any:
    """Await ``aw`` unless ``gone`` is set first (then it is cancelled and WorkerLeft raised)."""
    if gone is None:
        return await aw
    task = asyncio.ensure_future(aw)
    waiter = asyncio.ensure_future(gone.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        waiter.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise WorkerLeft()


async def swap_weights(clients: Sequence[Any], version: int, load: Callable[[Any], Any],
                       before: Optional[Callable[[], None]] = None,
                       gone: Optional[Callable[[Any], Optional[asyncio.Event]]] = None, *,
                       pause: bool = True) -> WeightSwap:
    """pause(in_place) -> ``before()`` -> ``load(client)`` on every client at once -> continue.

    ``pause=False``: no pause and no continue, for workers that stage an update while they generate and
    swap it in between two decode steps themselves (the embedded engine: workers/inference/embedded/
    weight_swap.py); their tokens carry per-token versions either way.

    ``clients`` are workers.common.inference_client.InferenceClient; ``load`` returns the
    coroutine of the transport's admin call (its answer: ``{success, weights_digest?}``).
    ``gone(client)``: an event set once that worker is marked dead (WorkerPool.gone); the swap
    then stops waiting on it at once (a hung worker held every update for the client's whole
    timeout) and lists it in ``WeightSwap.left``, not among the failures.
    """
    t0 = time.perf_counter()
    events = [gone(c) if gone is not None else None for c in clients]
    if pause:
        paused = await asyncio.gather(*(_unless_gone(c.pause_generation(mode="in_place"), e)
                                        for c, e in zip(clients, events)), return_exceptions=True)
    else:
        paused = [None] * len(clients)

    async def load_one(c: Any, p: Any, e: Optional[asyncio.Event]) -> Any:
        if isinstance(p, WorkerLeft):
            raise p
        return await _unless_gone(load(c), e)

    results: list = [None] * len(clients)
    try:
        if before is not None:
            before()
        results = await asyncio.gather(*(load_one(c, p, e) for c, p, e in zip(clients, paused, events)),
                                       return_exceptions=True)
    finally:  # a worker that paused must continue, whatever happened to the others
        await asyncio.gather(*(_unless_gone(c.continue_generation(), e) for c, p, e in zip(clients, paused, events)
                               if pause and not isinstance(p, BaseException)), return_exceptions=True)
    left = [c for c, r in zip(clients, results) if isinstance(r, WorkerLeft)]
    failed = [(c, p if isinstance(p, BaseException) else r) for c, p, r in zip(clients, paused, results)
              if not isinstance(r, WorkerLeft) and (isinstance(p, BaseException) or isinstance(r, BaseException)
                                                    or not r.get("success", False))]
    if failed:
        raise WeightUpdateError(f"weight update to version {version} failed on {len(failed)} worker(s): "
                                + "; ".join(f"{c.base_url}: {why}" for c, why in failed),
                                content=all(_refused_content(why) for _, why in failed))
    return WeightSwap(time.perf_counter() - t0, [None if c in left else r.get("weights_digest")
                                                 for c, r in zip(clients, results)], left,
                      [None if c in left else r for c, r in zip(clients, results)])


def _refused_content(why: Any) -> bool:
    """The worker answered and refused the update itself (400, or ``success: false``)."""
    if isinstance(why, BaseException):
        return getattr(why, "status", None) == 400
    return isinstance(why, dict)


class WeightCoordinator(abc.ABC):
    """One run's orchestrator side of a transport.

    ``pool`` (workers/orchestrator/faults.WorkerPool) offers ``clients`` (every server),
    ``live_clients()`` and ``await check_live()``; the coordinator keeps ``version`` (what
    every updated worker serves), ``update_s`` (the last swap's time) and the verify counts,
    which the orchestrator copies into each batch's metrics.
    """

    pauses_generation = True
    """Whether an update holds the workers' requests paused (the orchestrator then leaves that busy time
    out of ``generation_s``: workers/common/timeline.py)."""

    def __init__(self, cfg: Any, paths: Any, *, log: Any):
        self.cfg, self.paths, self.log = cfg, paths, log
        self.version = 0
        self.update_s: Optional[float] = None
        self.verified = self.mismatched = 0  # updates checked end to end (weights.verify)
        self.refused = 0  # versions every failing worker refused for their content (checksum, NaN, malformed)
        self.fallbacks = 0  # updates that went through the filesystem after the transport's own path failed
        self.retry = RetryPolicy()  # refused versions are not retried; other failures back off
        self.engine_timing: dict[str, float] = {}  # the last swap's slowest worker per part (slowest_parts)

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
        if expected is None or None in digests or self.cfg.trainer.dtype != held_dtype(self.cfg.inference.dtype):
            return  # nothing to compare (SGLang workers, weights.verify off, or a dtype cast on the way)
        bad = [c.base_url for c, d in zip(clients, digests) if d != expected]
        if bad:
            self.mismatched += 1
            self.log.error("weights v%d on %s differ from the trainer's (digest %s): not bit-identical", version,
                           ", ".join(bad), expected)
        else:
            self.verified += 1
