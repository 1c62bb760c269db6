"""Broadcast transport, orchestrator side: have every worker join the group, then drive updates.

``start``: wait for ``group.json`` (trainer rank 0; deadline weights.broadcast_timeout_s),
POST ``/init_weights_update_group`` to every worker at once. ``maybe_update``: when
``offer.json`` names a version not yet requested: pause every worker -> write
``request.json`` (the senders' cue) -> ``/update_weights_from_distributed`` on every worker
at once -> continue -> compare each worker's digest with the offer's. A refusal is not
retried: the next version is a full update again. With weights.delta, a version the trainer
offers as a patch is requested as one (``request.json`` {mode: delta}, load_format slurmrl_delta)
unless a worker may lack its base (a refusal, a failed update, a revived worker): then it goes
whole (buckets), which also re-anchors the trainer's snapshot. Protocol: the package docstring.

Revival (``revive``): a process group cannot take a member back, so once every dead worker
answers its health check again, the group is re-formed: destroy the old group on the live
workers -> ``reform.json`` {G+1} -> the senders form generation G+1 (group.json) -> every worker
joins it. The revived workers boot from step 0 on disk, so they stay out of service until the
next update (a full one: every version sends every tensor) reached them; then they are
readmitted at that version. While a worker is dead and not yet rejoined, no update is
requested (its receives would never be posted; the senders wait, deadline
weights.broadcast_timeout_s).
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable, Optional, Sequence

from workers.common.protocol import PeerTimeout
from workers.weights.broadcast.handshake import Handshake, group_name_of
from workers.weights.broadcast.join import join_announced_group
from workers.weights.coordinator import WeightCoordinator, WeightSwap, WeightUpdateError, swap_weights


async def update_all_workers_distributed(clients: Sequence[Any], group: dict, version: int, *,
                                         request: Callable[[], None], timeout_s: float,
                                         load_format: str = "slurmrl_buckets") -> WeightSwap:
    """pause(in_place) -> ``request()`` (the trainer's cue to send) -> receive -> continue.

    ``group`` is the trainer's group.json (handshake.py): its names, dtypes and shapes are
    announced to every worker with SGLang's fields. Every worker is asked to receive, even
    one that failed to pause: the senders wait for all of them. ``load_format``: ``slurmrl_buckets``
    (every tensor) or ``slurmrl_delta`` (a sparse patch on the previous version, applied in place).
    """
    def receive(c):
        return c.update_weights_from_distributed(names=group["names"], dtypes=group["dtypes"], shapes=group["shapes"],
                                                 group_name=group["group_name"], weight_version=version,
                                                 load_format=load_format, timeout_s=timeout_s)

    return await swap_weights(clients, version, receive, before=request)


class BroadcastCoordinator(WeightCoordinator):
    def __init__(self, cfg: Any, paths: Any, *, log: Any):
        super().__init__(cfg, paths, log=log)
        self.handshake = Handshake(paths.root)
        self.group: Optional[dict] = None  # group.json once every worker joined
        self.requested_version = 0
        self.clients: list = []
        self.generation, self.reforming, self.updating = 0, False, False
        self.rejoined: set[int] = set()  # revived workers in the re-formed group, readmitted by the next update
        self.attempted = cfg.weights.group_name  # the last group name the workers were asked to join
        self.need_full = False  # weights.delta: a worker may lack the last version, the next goes whole
        self.broken = False  # an update failed in transit: the group is re-formed before the next request

    async def start(self, clients: Sequence[Any]) -> None:
        """Every worker joins trainer rank 0's group."""
        info = await join_announced_group(self.handshake, self.cfg, clients)
        self.group, self.clients = info, list(clients)
        self.log.info("%d workers joined weight group %s (%s, world %d)", len(clients), info["group_name"],
                      info["backend"], info["world_size"])

    async def maybe_update(self, pool: Any) -> None:
        """If the trainer offers newer weights: pause -> request -> receive -> continue (every
        group member: the senders wait for all of them). Not while a member is dead or the group
        re-forms; rejoined workers are readmitted once an update reached them."""
        offer = self.handshake.offered()
        if self.group is None or offer is None or offer["version"] <= self.requested_version or self.reforming:
            return
        if any(not pool.alive[i] and i not in self.rejoined for i in range(len(self.clients))):
            return  # a member is gone: wait for it to come back and rejoin (revive)
        if self.broken and not await self._reform_broken(pool):
            return
        v = self.requested_version = offer["version"]  # each version is sent once: a refusal waits for the next
        # weights.delta: a patch only when the trainer offers one and every worker holds its base
        mode = "delta" if offer.get("delta") and not self.need_full and not self.rejoined else "full"
        self.updating = True
        try:
            swap = await update_all_workers_distributed(
                self.clients, self.group, v, request=lambda: self.handshake.request(v, mode),
                timeout_s=self.cfg.weights.broadcast_timeout_s,
                load_format="slurmrl_delta" if mode == "delta" else "slurmrl_buckets")
            self.update_s, self.version = swap.seconds, v
            self.verify(v, self.clients, swap.digests, offer.get("digest"))
        except WeightUpdateError as e:
            self.log.warning("%s", e)
            self.rejoined.clear()  # not readmitted: once they answer again the group is re-formed anew
            self.need_full = True  # a refusing worker kept its weights: the next version goes whole to all
            self.broken = not e.content  # refused for its content: the transfer itself went through
            return
        finally:
            self.updating = False
        self.need_full = False
        for w in sorted(self.rejoined):
            pool.readmit(w, v)
        self.rejoined.clear()

    async def revive(self, pool: Any, worker: int, current: Callable[[], tuple[int, Optional[str]]]) -> bool:
        """Once every dead worker answers again, re-form the group with them (module docstring).
        They are readmitted by the next update (maybe_update), so this returns False."""
        if self.group is None or self.reforming or self.updating or pool.alive[worker] or worker in self.rejoined:
            return False  # (an update in flight ends first: its receives must not meet a destroyed group)
        dead = [i for i in range(len(self.clients)) if not pool.alive[i] and i not in self.rejoined]
        if not all([await pool.healthy(i) for i in dead]):
            return False
        self.reforming = True
        try:
            await self.reform(dead)
            self.rejoined.update(dead)
        except (WeightUpdateError, PeerTimeout) as e:
            self.log.warning("re-forming the weight group with revived worker(s) %s failed (retried on the next "
                             "health round): %s", dead, e)
        finally:
            self.reforming = False
        return False

    async def _reform_broken(self, pool: Any) -> bool:
        """After an update that failed in transit, re-form the group before requesting another version.

        Why: the senders skip a version whose transfer failed and stop on a second failure in the same
        generation (publisher._send). A worker restarted between two health checks (a Slurm step
        respawned within a second) is never marked dead, so :meth:`revive` never runs, and the next
        request on the old group would fail again and stop the trainer. Waits (False) until every
        member answers its health check; a member that does not is marked dead by the health rounds
        and comes back through :meth:`revive`, which re-forms the group too."""
        if not all([await pool.healthy(i) for i in range(len(self.clients))]):
            return False
        self.reforming = True
        try:
            await self.reform([])
        except (WeightUpdateError, PeerTimeout) as e:
            self.log.warning("re-forming the weight group after a failed update failed (retried on the next turn): %s", e)
            return False
        finally:
            self.reforming = False
        return True

    async def reform(self, revived: Sequence[int]) -> None:
        """destroy the old group on the live workers -> reform.json -> wait for the senders' group.json -> join all."""
        w, old = self.cfg.weights, self.group
        live = [c for i, c in enumerate(self.clients) if i not in revived]
        await asyncio.gather(*(c.destroy_weights_update_group(name, timeout_s=w.broadcast_timeout_s)
                               for c in live for name in {old["group_name"], self.attempted}), return_exceptions=True)
        g = self.generation + 1
        self.attempted = group_name_of(w.group_name, g)
        self.handshake.reform(g)
        self.log.info("re-forming weight group as generation %d %s", g, f"with revived worker(s) {list(revived)}"
                      if revived else "after an update that failed in transit")
        info = await join_announced_group(self.handshake, self.cfg, self.clients, generation=g)
        self.group, self.generation, self.broken = info, g, False


def make_coordinator(cfg: Any, paths: Any, *, log: Any) -> WeightCoordinator:
    """TransportSpec.coordinator: the bucket protocol for embedded workers, SGLang's for SGLang servers."""
    from workers.common.registry import speaks_sglang

    if speaks_sglang(cfg):
        from workers.weights.sglang.broadcast_coordinator import SGLangBroadcastCoordinator

        return SGLangBroadcastCoordinator(cfg, paths, log=log)
    return BroadcastCoordinator(cfg, paths, log=log)
