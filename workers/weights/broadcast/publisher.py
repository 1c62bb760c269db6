"""Broadcast transport, trainer side: senders pack buckets and broadcast them into inference memory.

The protocol (setup, per-update handshake, who waits for whom) is in the package docstring
(workers/weights/broadcast/__init__.py); the group and the bucket plan in group.py.
NaN/inf: each sender checks its share on its device before rank 0 offers the version
(checksums.nonfinite_names), and all senders refuse or skip together (group_publisher.py).
"""
from __future__ import annotations

import collections
import dataclasses
import datetime
import logging
import time
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import xxhash

from workers.common.protocol import PeerTimeout, RunPaths
from workers.common.registry import TRANSPORTS
from workers.weights.base import Peers, SyncStats, TensorMeta, WeightPublisher, assign_shares, peers_for
from workers.weights.broadcast.group import (PLAN_KEY, Bucket, WeightGroup, backend_for, make_header,
                                             metas_from_json, metas_to_json)
from workers.weights.broadcast.delta_wire import PatchSender
from workers.weights.delta import patch_bytes_per_element
from workers.weights.broadcast.group_publisher import GroupPublisher
from workers.weights.broadcast.handshake import group_name_of
from workers.weights.coordinator import receiver_rank_counts
from workers.weights.checksums import buffer_checksum, byte_view, state_digest, tensor_hash
from workers.weights.shards import dtype_from_name
from workers.weights.stream import WeightStream
log = logging.getLogger("slurmrl.weights")


class BucketSender:
    """One sender's half of an update: its buckets, packed into two reusable send buffers."""

    def __init__(self, group: WeightGroup, *, depth: int = 2):
        self.group = group
        self.mine = [b for b in group.plan if b.sender == group.rank]
        biggest = max((b.nbytes for b in self.mine if len(b.entries) > 1), default=0)
        self.slots = [torch.empty(biggest, dtype=torch.uint8, device=group.device) for _ in range(depth)]
        self.bytes = sum(b.nbytes for b in self.mine)

    def _pack(self, bucket: Bucket, tensors: Iterator[tuple[str, torch.Tensor]],
              slot: Optional[int]) -> tuple[torch.Tensor, str]:
        """(flat buffer to send, its checksum), from the bucket's tensors as the stream yields them
        (each dropped once copied). On CPU each tensor is hashed right after it was copied into the
        slot, while it is in cache (one pass over memory, not two)."""
        dtype = dtype_from_name(bucket.dtype)
        if slot is None:  # a lone tensor is sent from where it lives
            (_, t), = tensors
            flat = t.reshape(-1) if t.device == self.group.device and t.is_contiguous() else \
                t.to(self.group.device).reshape(-1).contiguous()
            return flat, buffer_checksum(flat)
        flat = self.slots[slot][: bucket.nbytes].view(dtype)
        h = xxhash.xxh3_64() if flat.device.type == "cpu" else None
        for e, off, (name, t) in zip(bucket.entries, bucket.offsets(), tensors, strict=True):
            assert name == e.name and tuple(t.shape) == e.shape and t.dtype == dtype, (e, name, t.shape, t.dtype)
            part = flat[off: off + t.numel()]
            part.copy_(t.reshape(-1))
            if h is not None:
                h.update(byte_view(part))
        return flat, (f"{h.intdigest():016x}" if h is not None else buffer_checksum(flat))

    def send(self, version: int, stream: WeightStream) -> int:
        """Broadcast every own bucket of ``stream`` as version ``version``; returns bytes sent.

        COLLECTIVE over the trainer ranks: every sender walks the WHOLE plan in order and asks
        the stream for each bucket's tensors (a gather each on a sharded model); the bucket's
        sender packs and sends them, the others drop them. So a rank holds at most its send
        slots plus the lone tensors in flight, never the model. Packing bucket i+1 overlaps the
        transfer of bucket i (the backend's threads move it); a send buffer is reused only once
        the broadcast that read it has completed.
        """
        pending: collections.deque = collections.deque()  # (slot, works, keep-alive tensors, what)
        packed = 0
        for b in self.group.plan:
            tensors = stream.items([e.name for e in b.entries])
            if b.sender != self.group.rank:
                collections.deque(tensors, maxlen=0)  # join the gathers, keep nothing
                continue
            slot = None
            if len(b.entries) > 1:
                slot, packed = packed % len(self.slots), packed + 1
                while any(p[0] == slot for p in pending):
                    self._finish(pending.popleft())
            buf, checksum = self._pack(b, tensors, slot)
            header = make_header(version, b, checksum, self.group.device)
            works = [self.group.broadcast(header, b), self.group.broadcast(buf, b)]
            pending.append((slot, works, (header, buf), f"sending bucket {b.index} of v{version}"))
            while len(pending) > len(self.slots):  # bounded: lone tensors in flight count too
                self._finish(pending.popleft())
        while pending:
            self._finish(pending.popleft())
        return self.bytes

    def _finish(self, item) -> None:
        _, works, _, what = item
        for w in works:
            self.group.wait(w, what)


class BroadcastPublisher(GroupPublisher):
    """Trainer side (the package docstring has the protocol). ``initial`` publishes step 0 to disk."""

    def __init__(self, paths: RunPaths, cfg, peers: Peers, *, initial: WeightPublisher, host: str, port: int,
                 num_receivers: int, device: Optional[torch.device] = None):
        super().__init__(paths, cfg, peers, initial=initial, host=host, port=port, num_receivers=num_receivers,
                         device=device)
        self.group: Optional[WeightGroup] = None
        self.sender: Optional[BucketSender] = None
        self.generation = 0
        self.broken_generation: Optional[int] = None  # a transfer of this generation failed (_send)
        self.store: Optional[dist.Store] = None
        self.addr: tuple[str, int] = (host, port)
        self.metas: list[TensorMeta] = []
        self.backend = cfg.backend
        self.patcher: Optional[PatchSender] = None  # weights.delta: snapshot + sums of what was sent last
        self.chain: Optional[int] = None  # the last version every receiver got (None: the next goes whole)
        self.anchor_version = 0
        self.last_patch: tuple[int, int] = (0, 0)  # (elements changed, compared) on this rank, last patch

    @property
    def formed(self) -> bool:
        return self.group is not None

    def publish(self, version: int, weights) -> SyncStats:
        first = not self.formed
        out = super().publish(version, weights)
        if first and self.patcher is not None:  # step 0 on disk is what every receiver boots from
            self.chain = self.anchor_version = version
        return out

    def _patchable(self, version: int) -> bool:
        """weights.delta: may ``version`` go as a patch (the chain is intact and no anchor is due)?"""
        return (self.patcher is not None and self.chain == version - 1
                and version - self.anchor_version < self.cfg.delta_full_every)

    def _update(self, version: int, stream: WeightStream) -> SyncStats:
        digest = self._digest(stream) if self.cfg.verify else None  # collective: a hashing pass
        patchable, patch = self._patchable(version), None
        if patchable:  # diff now (collective): a patch bigger than half the model goes whole instead
            self.patcher.repoint(stream)
            patch = self.patcher.diff()
            patchable = self._worth_it(patch[2], patch[3])
        if self.peers.rank == 0:
            self.handshake.offer(version, digest, delta=patchable)
        t0 = time.perf_counter()
        if not self._wait_for_request(version):
            self.finished = True
            return SyncStats(bytes=0, seconds=0.0, wait_s=time.perf_counter() - t0, skipped=True)
        t1 = time.perf_counter()
        as_patch = patchable and self.handshake.requested_mode() == "delta"
        if as_patch:
            failed, nbytes = self._send_patch(version, patch)
        else:
            sent = self._send(version, lambda: self.sender.send(version, stream))
            failed, nbytes = sent is None, sent or 0
        seconds = time.perf_counter() - t1
        if self.peers.world_size > 1:  # the update lasts until the slowest sender is done; failed if one failed
            got = self.peers.all_gather_object((seconds, failed, nbytes))
            seconds, failed, nbytes = max(s for s, _, _ in got), any(f for _, f, _ in got), sum(b for _, _, b in got)
        if self.patcher is not None:
            if failed:
                self.chain = None  # some receiver may lack this version: the next one goes whole
            else:
                if not as_patch:  # a full send is an anchor: snapshot what was sent (collective)
                    self.patcher.repoint(stream)
                    self.patcher.anchor()
                    self.anchor_version = version
                self.chain = version
        if failed:
            return SyncStats(bytes=0, seconds=seconds, wait_s=t1 - t0, skipped=True)
        return SyncStats(bytes=nbytes, seconds=seconds, wait_s=t1 - t0)

    def _worth_it(self, changed: int, compared: int) -> bool:
        """Is a patch cheaper than half a full send, over all ranks (the same answer on each)?"""
        got = self.peers.all_gather_object((changed, compared)) if self.peers.world_size > 1 else [(changed, compared)]
        changed, compared = sum(c for c, _ in got), sum(n for _, n in got)
        item = self.patcher.tracker.sources[0].dtype.itemsize if self.patcher.tracker.sources else 2
        return patch_bytes_per_element(changed / max(compared, 1), item) <= 0.5 * item

    def _send_patch(self, version: int, patch) -> tuple[bool, int]:
        """This rank's patch of ``version`` (delta_wire.py, diffed before the offer); (failed, payload bytes)."""
        parts, sums, changed, compared = patch
        self.last_patch = (changed, compared)
        sent = self._send(version, lambda: self.patcher.send(self.group, version, parts, sums, self.group.receivers))
        return sent is None, sent or 0

    def wait(self, ready: Callable[[], bool], *, timeout_s: float, what: str) -> None:
        """The trainer waiting for a batch: also re-form the group when the orchestrator asks
        (reform.json). Revived workers boot from step 0, too stale to produce the batch the trainer
        waits for, so the re-formation cannot wait for the next publish. Every poll is one
        all-gather among the trainer ranks (lockstep): they join together, and leave together once
        all of them see ``ready``; a rank alone in ``_join`` would deadlock the others' training."""
        deadline = time.monotonic() + timeout_s
        while True:
            seen = (bool(ready()), self.handshake.reform_requested() if self.group is not None else 0)
            views = self.peers.all_gather_object(seen) if self.peers.world_size > 1 else [seen]
            if all(r for r, _ in views):
                return
            generation = min(g for _, g in views)
            if generation > self.generation:
                self._join(generation)
                continue
            if time.monotonic() > deadline:
                raise PeerTimeout(f"trainer rank {self.peers.rank}: no {what} from the orchestrator within "
                                  f"{timeout_s:.0f}s; is it alive? see its log")
            time.sleep(0.02 if self.peers.world_size == 1 else 0.1)

    @staticmethod
    def _digest(stream: WeightStream) -> str:
        """The whole-model digest the offer carries (weights.verify): every rank streams every
        tensor (the gathers pair up); each is hashed and dropped, so no rank holds the model."""
        return state_digest({name: tensor_hash(t) for name, t in stream.items()})

    def _send(self, version: int, send: Callable[[], int]):
        """Run ``send`` (this rank's buckets or patch); its bytes, or None when the transfer failed.

        A receiver that dies during an update breaks the group for every member: this version is
        skipped, and the next one waits for the orchestrator to re-form the group with the
        respawned worker (reform.json). A second failure in the same generation is no death
        the orchestrator will repair: it stops the trainer."""
        try:
            return send()
        except TimeoutError as e:
            if self.broken_generation == self.generation:
                raise
            self.broken_generation = self.generation
            log.warning("trainer rank %d: weights v%d not delivered (%s); skipped until the orchestrator re-forms "
                        "the weight group", self.peers.rank, version, e)
            return None

    def _wait_for_request(self, version: int) -> bool:
        deadline = time.monotonic() + self.cfg.broadcast_timeout_s
        while True:
            if self.handshake.reform_requested() > self.generation:  # revived workers: a new generation first
                self._join(self.handshake.reform_requested())
                deadline = time.monotonic() + self.cfg.broadcast_timeout_s
            if self.handshake.requested() == version:
                return True
            if self.paths.orchestrator_done.exists():
                return False  # the orchestrator finished: no worker will ever receive this
            if time.monotonic() > deadline:
                raise PeerTimeout(f"trainer rank {self.peers.rank}: the orchestrator did not request weights v{version} "
                                  f"within {self.cfg.broadcast_timeout_s:.0f}s ({self.handshake.dir}/request.json); "
                                  f"is the orchestrator alive? see its log")
            time.sleep(0.005)

    def _form(self, stream: WeightStream) -> None:
        """Generation 0: rank 0 opens the group's TCPStore, every sender joins."""
        cfg, rank = self.cfg, self.peers.rank
        timeout = datetime.timedelta(seconds=cfg.broadcast_timeout_s)
        self.metas = list(stream.metas)
        if rank == 0:
            self.store = dist.TCPStore(self.host, self.port, None, True, timeout=timeout, wait_for_workers=False)
        self.addr = self.peers.all_gather_object((self.host, self.store.port) if rank == 0 else None)[0]
        if rank != 0:
            self.store = dist.TCPStore(self.addr[0], self.addr[1], None, False, timeout=timeout)
        self.backend = cfg.backend if cfg.backend != "auto" else backend_for(self.device)
        self._join(0)
        if cfg.delta:  # the snapshot starts as what was just published to disk (collective)
            self.patcher = PatchSender(stream, self.peers)
            self.patcher.anchor()

    def _join(self, generation: int) -> None:
        """Form generation ``generation`` of the group on the same store (a re-formation names
        its keys anew: group_name_of); rank 0 announces it in group.json. No collective among
        the senders: each one sees reform.json while waiting for a request."""
        cfg, rank, k = self.cfg, self.peers.rank, self.peers.world_size
        if self.group is not None:
            self.group.close()
            log.info("trainer rank %d: re-forming the weight group as generation %d (revived workers)", rank, generation)
        name, world = group_name_of(cfg.group_name, generation), k + self.num_receivers
        if rank == 0:
            self.handshake.write_group({
                "master_address": self.addr[0], "master_port": self.addr[1], "world_size": world, "num_senders": k,
                "group_name": name, "backend": self.backend, "generation": generation,
                "names": [m.name for m in self.metas], "dtypes": [m.dtype for m in self.metas],
                "shapes": [list(m.shape) for m in self.metas]})
        self.group = join_as_sender(self.store, rank=rank, num_senders=k, world_size=world,
                                    share=assign_shares(self.metas, k)[rank], group_name=name, backend=self.backend,
                                    device=self.device, timeout_s=cfg.broadcast_timeout_s,
                                    bucket_bytes=cfg.bucket_size_mb << 20, lone_bytes=cfg.lone_tensor_mb << 20,
                                    where=f"{self.addr[0]}:{self.addr[1]}", delta=cfg.delta)
        self.sender = BucketSender(self.group)
        self.generation = generation

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        self.initial.close()


def join_as_sender(store: dist.Store, *, rank: int, num_senders: int, world_size: int, share: Sequence[TensorMeta],
                   group_name: str, backend: str, device: torch.device, timeout_s: float, bucket_bytes: int,
                   where: str, lone_bytes: Optional[int] = None, delta: bool = False) -> WeightGroup:
    """Sender ``rank`` joins: puts its share's manifest (rank 0 also the plan settings), waits
    for every sender and receiver, forms the backends. Returns the formed group."""
    group = WeightGroup(store, rank=rank, world_size=world_size, group_name=group_name, backend=backend, device=device,
                        timeout_s=timeout_s, where=where)
    group.put("sender", metas_to_json(share))
    if rank == 0:
        group.put(PLAN_KEY, {"num_senders": num_senders, "bucket_bytes": bucket_bytes, "lone_bytes": lone_bytes,
                             "delta": delta})
    manifests = {r: metas_from_json(v) for r, v in group.collect("sender", range(num_senders), who="trainer").items()}
    holdings = {r: v["experts"] for r, v in group.collect(
        "receiver", range(num_senders, world_size), who="inference (orchestrator: /init_weights_update_group)").items()}
    group.form(manifests, holdings, bucket_bytes, lone_bytes, delta=delta)
    return group


def make_publisher(cfg, paths, topology, *, rank: int, world_size: int,
                   device: Optional[torch.device] = None) -> WeightPublisher:
    """TransportSpec.publisher: step 0 through the filesystem, then the group hosted by rank 0
    at ``topology.weights_group_addr`` (else master_addr on a free port): buckets for embedded
    workers, SGLang's own protocol for SGLang servers (sglang/broadcast_publisher.py)."""
    from workers.common.registry import speaks_sglang

    peers = peers_for(rank, world_size)
    host, port = topology.master_addr, 0
    if topology.weights_group_addr:
        host, _, p = topology.weights_group_addr.rpartition(":")
        port = int(p)
    # the steps this transport writes (step 0, fallbacks, SGLang's anchors) are loaded whole by servers
    # (/update_weights_from_disk): full steps, whatever weights.delta says about the wire. The filesystem
    # transport writes them, reached through the registry as the trainer reaches any transport (no import)
    disk_cfg = dataclasses.replace(cfg, weights=dataclasses.replace(cfg.weights, delta=False))
    initial = TRANSPORTS.get("filesystem").publisher(disk_cfg, paths, topology, rank=rank, world_size=world_size)
    if speaks_sglang(cfg):
        from workers.weights.sglang.broadcast_publisher import SGLangBroadcastPublisher

        return SGLangBroadcastPublisher(paths, cfg.weights, peers, initial=initial, host=host, port=port,
                                        num_receivers=sum(receiver_rank_counts(cfg)),
                                        inference_dtype=cfg.inference.dtype, device=device)
    return BroadcastPublisher(paths, cfg.weights, peers, initial=initial,
                              host=host, port=port, num_receivers=sum(receiver_rank_counts(cfg)), device=device)
