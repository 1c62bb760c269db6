"""Orchestrator side of joining a weight group: every inference server at its rank offset.

Both coordinators use this (coordinator.py for embedded workers, sglang/broadcast_coordinator.py for
SGLang servers); it lives apart from both so that neither imports the other (the factory in
coordinator.py imports sglang/broadcast_coordinator lazily). No torch: the orchestrator imports it.

Protocol: ``/init_weights_update_group`` goes to every server at once, because each call
returns only once the whole group exists (the senders and every other server joined), so
posting them one after another would deadlock. Server i joins at rank ``num_senders + (ranks
of servers 0..i-1)``: the trainer's senders are ranks 0..num_senders-1 (SGLang's protocol has
one sender, trainer rank 0), and a server contributes one rank per TP rank.
"""
from __future__ import annotations

import asyncio
from typing import Any, Optional, Sequence

from workers.common.protocol import wait_for
from workers.weights.broadcast.handshake import Handshake, rank_offsets
from workers.weights.coordinator import receiver_rank_counts
from workers.weights.coordinator import WeightUpdateError


async def join_weight_group(clients: Sequence[Any], group: dict, rank_counts: Sequence[int], *,
                            timeout_s: float) -> list[int]:
    """Every server in ``clients`` joins ``group`` (the trainer's group.json); returns their rank offsets.

    ``rank_counts``: group ranks per server (workers.weights.coordinator.receiver_rank_counts), in client order.
    A layout the trainer did not plan for (world_size off) fails before any call is made; a
    server that cannot join is named in the WeightUpdateError with its answer.
    """
    num_senders = int(group.get("num_senders", 1))
    if group["world_size"] != num_senders + sum(rank_counts) or len(rank_counts) != len(clients):
        raise WeightUpdateError(f"weight group world_size({group['world_size']}) != num_senders({num_senders})"
                                f" + inference ranks({sum(rank_counts)} over {len(rank_counts)} servers; "
                                f"{len(clients)} clients): trainer and orchestrator disagree on the inference layout")
    offsets = rank_offsets(list(rank_counts), num_senders)
    results = await asyncio.gather(*(c.init_weights_update_group(
        master_address=group["master_address"], master_port=group["master_port"], rank_offset=off,
        world_size=group["world_size"], group_name=group["group_name"], backend=group["backend"], timeout_s=timeout_s)
        for c, off in zip(clients, offsets)), return_exceptions=True)
    failures = [f"{c.base_url}: {r}" for c, r in zip(clients, results) if isinstance(r, BaseException)]
    if failures:
        raise WeightUpdateError(f"{len(failures)} server(s) could not join weight group {group['group_name']!r}: "
                                + "; ".join(failures))
    return offsets


async def join_announced_group(handshake: Handshake, cfg: Any, clients: Sequence[Any], *,
                               generation: Optional[int] = None) -> dict:
    """Wait for trainer rank 0's ``group.json`` (of ``generation`` when given: a re-formation),
    then have every server join it; returns the group. Both waits have the deadline
    ``weights.broadcast_timeout_s`` and name the peer they wait for."""
    w = cfg.weights
    ready = handshake.read_group if generation is None else (lambda: handshake.group_of(generation))
    what = f"{handshake.dir}/group.json" + ("" if generation is None else f" generation {generation}")
    info = await asyncio.to_thread(wait_for, ready, timeout_s=w.broadcast_timeout_s, what=what, peer="trainer rank 0")
    await join_weight_group(clients, info, receiver_rank_counts(cfg), timeout_s=w.broadcast_timeout_s)
    return info
