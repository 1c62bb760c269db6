"""Rollout mechanics: the inference busy meter, and swapping weights on every worker
(prompt groups run through episodes.py, for every env).

Weight update protocol (the only sync point; the orchestrator drives it, workers obey):
  1. ``/pause_generation`` mode=in_place on EVERY worker (in-flight requests keep their KV
     cache and wait; nothing is aborted),
  2. ``/update_weights_from_disk`` model_path=weights/step_V, weight_version=V on every
     worker (each verifies checksums; on refusal it keeps its old weights),
  3. ``/continue_generation`` on every worker, also when step 2 failed somewhere (so a bad
     step never freezes inference).
With ``weights.transport=broadcast`` step 2 is: write ``weights/broadcast/request.json``
(the trainer's cue, workers/weights/handshake.py), then ``/update_weights_from_distributed``
on every worker at once; they receive the buckets the trainer ranks broadcast
(workers/weights/broadcast.py has the whole protocol). A refusal there is not retried: the
next version is a full update again.
Requests that spanned the update carry per-token versions, so staleness stays exact.
Every call has the client's timeout; failures carry the worker URL and response text.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Callable, Optional, Sequence

from workers.common.inference_client import InferenceClient
from workers.weights.handshake import rank_offsets


class WeightUpdateError(RuntimeError):
    """At least one worker refused or failed a weight update."""


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


@dataclasses.dataclass
class WeightSwap:
    seconds: float
    """pause -> load -> continue, as the orchestrator waited for it."""
    digests: list[Optional[str]]
    """Per worker, the ``weights_digest`` it reported after applying (None: not reported)."""


async def update_all_workers(clients: Sequence[InferenceClient], model_path: str, version: int) -> WeightSwap:
    """pause(in_place) -> load from disk -> continue on every worker."""
    return await _swap_weights(clients, version, lambda c: c.update_weights_from_disk(model_path, version))


async def update_all_workers_distributed(clients: Sequence[InferenceClient], group: dict, version: int, *,
                                         request: Callable[[], None], timeout_s: float) -> WeightSwap:
    """pause(in_place) -> ``request()`` (the trainer's cue to send) -> receive -> continue.

    ``group`` is the trainer's group.json (workers.weights.handshake): its names, dtypes and
    shapes are announced to every worker with SGLang's fields. Every worker is asked to
    receive, even one that failed to pause: the senders wait for all of them.
    """
    def receive(c: InferenceClient):
        return c.update_weights_from_distributed(names=group["names"], dtypes=group["dtypes"], shapes=group["shapes"],
                                                 group_name=group["group_name"], weight_version=version,
                                                 load_format="slurmrl_buckets", timeout_s=timeout_s)

    return await _swap_weights(clients, version, receive, before=request)


async def join_weight_group(clients: Sequence[InferenceClient], group: dict, rank_counts: Sequence[int], *,
                            timeout_s: float) -> None:
    """/init_weights_update_group on every worker at once (each call returns once the group
    exists, so all must be in flight together); worker i's rank_offset follows the senders."""
    if group["world_size"] != group["num_senders"] + sum(rank_counts) or len(rank_counts) != len(clients):
        raise WeightUpdateError(f"weight group world_size({group['world_size']}) != num_senders({group['num_senders']})"
                                f" + inference ranks({sum(rank_counts)} over {len(rank_counts)} servers; "
                                f"{len(clients)} clients): trainer and orchestrator disagree on the inference layout")
    offsets = rank_offsets(list(rank_counts), group["num_senders"])
    results = await asyncio.gather(*(c.init_weights_update_group(
        master_address=group["master_address"], master_port=group["master_port"], rank_offset=off,
        world_size=group["world_size"], group_name=group["group_name"], backend=group["backend"], timeout_s=timeout_s)
        for c, off in zip(clients, offsets)), return_exceptions=True)
    failures = [f"{c.base_url}: {r}" for c, r in zip(clients, results) if isinstance(r, BaseException)]
    if failures:
        raise WeightUpdateError(f"{len(failures)} worker(s) could not join weight group {group['group_name']!r}: "
                                + "; ".join(failures))


async def _swap_weights(clients: Sequence[InferenceClient], version: int, load: Callable[[InferenceClient], Any],
                        before: Optional[Callable[[], None]] = None) -> WeightSwap:
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
