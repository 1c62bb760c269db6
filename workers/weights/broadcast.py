"""Broadcast weight transport: trainer ranks send buckets straight into inference memory.

Who waits for whom (every wait has a deadline: ``weights.broadcast_timeout_s``, naming
the peer):

Setup, once (trainer rank 0 hosts the group's TCPStore):
  T  every trainer rank publishes weights step 0 through the filesystem (workers boot
     from it), then rank 0 opens the store, writes ``weights/broadcast/group.json``
     (handshake.py); each sender puts its share's manifest on the store and waits for
     every receiver to join.
  O  the orchestrator, once every worker is ready, reads group.json and POSTs
     ``/init_weights_update_group`` {master_address, master_port, rank_offset, world_size,
     group_name, backend} to every worker at once; each worker (BroadcastReceiver) joins
     the store, says which experts it holds, and answers once its backends exist.
  all members compute the same bucket plan and create their backends (group.py).

Per update V (after trainer step V-1):
  T  rank 0 writes ``offer.json`` {V}; every sender waits for ``request.json`` == V (or the
     orchestrator's DONE: nobody will receive any more, sending stops for the run).
  O  sees the offer: ``/pause_generation`` (in_place) on every worker, writes request.json,
     POSTs ``/update_weights_from_distributed`` {names, dtypes, shapes, group_name,
     weight_version: V, ...} to every worker at once, then ``/continue_generation``.
  T  each sender, per bucket of its own (plan order): pack (zero-copy for a lone tensor),
     checksum, broadcast the header [magic, V, bucket, nbytes, checksum] then the data.
  W  the worker posts a receive for every bucket it needs into its preallocated staging
     buffer, checks each header and checksum as the bucket lands (hashing in threads
     while later buckets arrive), checks names/dtypes/shapes against the announced
     metadata and its model, and only then copies into the model. Any failure drains
     the remaining buckets (the senders are never left hanging) and refuses the update:
     the worker keeps serving the weights it had.
"""
from __future__ import annotations

import collections
import datetime
import time
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import xxhash

from workers.common.protocol import PeerTimeout, RunPaths
from workers.weights.base import Peers, SyncStats, TensorMeta, WeightLoadError, WeightPublisher, assign_shares
from workers.weights.checksums import (Hasher, buffer_checksum, byte_view, digest_from_int64, digest_int64,
                                       state_digest, state_hashes)
from workers.weights.group import (PLAN_KEY, Bucket, WeightGroup, backend_for, metas_from_json,
                                   metas_to_json)
from workers.weights.handshake import Handshake
from workers.weights.shards import ALIGN, dtype_from_name

MAGIC = 0x57474854  # "WGHT"
HEADER_LEN = 6


def _header(version: int, bucket: Bucket, checksum: str, device: torch.device) -> torch.Tensor:
    return torch.tensor([MAGIC, version, bucket.index, bucket.nbytes, *digest_int64(checksum)], dtype=torch.int64,
                        device=device)


class BucketSender:
    """One sender's half of an update: its buckets, packed into two reusable send buffers."""

    def __init__(self, group: WeightGroup, *, depth: int = 2):
        self.group = group
        self.mine = [b for b in group.plan if b.sender == group.rank]
        biggest = max((b.nbytes for b in self.mine if len(b.entries) > 1), default=0)
        self.slots = [torch.empty(biggest, dtype=torch.uint8, device=group.device) for _ in range(depth)]
        self.bytes = sum(b.nbytes for b in self.mine)

    def _pack(self, bucket: Bucket, state: Mapping[str, torch.Tensor], slot: Optional[int]) -> tuple[torch.Tensor, str]:
        """(flat buffer to send, its checksum). On CPU each tensor is hashed right after it was
        copied into the slot, while it is in cache (one pass over memory, not two)."""
        dtype = dtype_from_name(bucket.dtype)
        if slot is None:  # a lone tensor is sent from where it lives
            t = state[bucket.entries[0].name].detach()
            flat = t.reshape(-1) if t.device == self.group.device and t.is_contiguous() else \
                t.to(self.group.device).reshape(-1).contiguous()
            return flat, buffer_checksum(flat)
        flat = self.slots[slot][: bucket.nbytes].view(dtype)
        h = xxhash.xxh3_64() if flat.device.type == "cpu" else None
        for e, off in zip(bucket.entries, bucket.offsets()):
            t = state[e.name].detach()
            assert tuple(t.shape) == e.shape and t.dtype == dtype, (e, t.shape, t.dtype)
            part = flat[off: off + t.numel()]
            part.copy_(t.reshape(-1))
            if h is not None:
                h.update(byte_view(part))
        return flat, (f"{h.intdigest():016x}" if h is not None else buffer_checksum(flat))

    def send(self, version: int, state: Mapping[str, torch.Tensor]) -> int:
        """Broadcast every own bucket of ``state`` as version ``version``; returns bytes sent.

        Packing bucket i+1 overlaps the transfer of bucket i (the backend's threads move
        it); a send buffer is reused only once the broadcast that read it has completed.
        """
        pending: collections.deque = collections.deque()  # (slot, works, keep-alive tensors, what)
        packed = 0
        for b in self.mine:
            slot = None
            if len(b.entries) > 1:
                slot, packed = packed % len(self.slots), packed + 1
                while any(p[0] == slot for p in pending):
                    self._finish(pending.popleft())
            buf, checksum = self._pack(b, state, slot)
            header = _header(version, b, checksum, self.group.device)
            works = [self.group.broadcast(header, b), self.group.broadcast(buf, b)]
            pending.append((slot, works, (header, buf), f"sending bucket {b.index} of v{version}"))
        while pending:
            self._finish(pending.popleft())
        return self.bytes

    def _finish(self, item) -> None:
        _, works, _, what = item
        for w in works:
            self.group.wait(w, what)


class BroadcastPublisher(WeightPublisher):
    """Trainer side (module docstring: the protocol). ``initial`` publishes step 0 to disk."""

    def __init__(self, paths: RunPaths, cfg, peers: Peers, *, initial: WeightPublisher, host: str, port: int,
                 num_receivers: int, device: Optional[torch.device] = None):
        self.paths, self.cfg, self.peers, self.initial = paths, cfg, peers, initial
        self.host, self.port, self.num_receivers = host, port, num_receivers
        self.device = torch.device(device or "cpu")
        self.handshake = Handshake(paths.root)
        self.group: Optional[WeightGroup] = None
        self.sender: Optional[BucketSender] = None
        self.finished = False
        if peers.rank == 0:
            self.handshake.reset()

    def publish(self, version: int, state: Mapping[str, torch.Tensor]) -> SyncStats:
        if self.group is None:
            out = self.initial.publish(version, state)  # workers start from a checkpoint on disk
            t0 = time.perf_counter()
            self._form(state)
            out.wait_s = time.perf_counter() - t0
            return out
        if self.finished:
            return SyncStats(bytes=0, seconds=0.0, skipped=True)
        if self.peers.rank == 0:
            self.handshake.offer(version, state_digest(state_hashes(state)) if self.cfg.verify else None)
        t0 = time.perf_counter()
        if not self._wait_for_request(version):
            self.finished = True
            return SyncStats(bytes=0, seconds=0.0, wait_s=time.perf_counter() - t0, skipped=True)
        t1 = time.perf_counter()
        self.sender.send(version, state)
        seconds = time.perf_counter() - t1
        if self.peers.world_size > 1:  # the update lasts until the slowest sender is done
            seconds = max(self.peers.all_gather_object(seconds))
        return SyncStats(bytes=sum(b.nbytes for b in self.group.plan), seconds=seconds, wait_s=t1 - t0)

    def _wait_for_request(self, version: int) -> bool:
        deadline = time.monotonic() + self.cfg.broadcast_timeout_s
        while True:
            if self.handshake.requested() == version:
                return True
            if self.paths.orchestrator_done.exists():
                return False  # the orchestrator finished: no worker will ever receive this
            if time.monotonic() > deadline:
                raise PeerTimeout(f"trainer rank {self.peers.rank}: the orchestrator did not request weights v{version} "
                                  f"within {self.cfg.broadcast_timeout_s:.0f}s ({self.handshake.dir}/request.json); "
                                  f"is the orchestrator alive? see its log")
            time.sleep(0.005)

    def _form(self, state: Mapping[str, torch.Tensor]) -> None:
        cfg, rank, k = self.cfg, self.peers.rank, self.peers.world_size
        timeout = datetime.timedelta(seconds=cfg.broadcast_timeout_s)
        metas = [TensorMeta.of(n, t) for n, t in state.items()]
        store = None
        if rank == 0:
            store = dist.TCPStore(self.host, self.port, None, True, timeout=timeout, wait_for_workers=False)
        addr = self.peers.all_gather_object((self.host, store.port) if rank == 0 else None)[0]
        if rank != 0:
            store = dist.TCPStore(addr[0], addr[1], None, False, timeout=timeout)
        backend = cfg.backend if cfg.backend != "auto" else backend_for(self.device)
        world = k + self.num_receivers
        if rank == 0:
            self.handshake.write_group({
                "master_address": addr[0], "master_port": addr[1], "world_size": world, "num_senders": k,
                "group_name": cfg.group_name, "backend": backend, "names": [m.name for m in metas],
                "dtypes": [m.dtype for m in metas], "shapes": [list(m.shape) for m in metas]})
        self.group = join_as_sender(store, rank=rank, num_senders=k, world_size=world,
                                    share=assign_shares(metas, k)[rank], group_name=cfg.group_name, backend=backend,
                                    device=self.device, timeout_s=cfg.broadcast_timeout_s,
                                    bucket_bytes=cfg.bucket_size_mb << 20, lone_bytes=cfg.lone_tensor_mb << 20,
                                    where=f"{addr[0]}:{addr[1]}")
        self.sender = BucketSender(self.group)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        self.initial.close()


def join_as_sender(store: dist.Store, *, rank: int, num_senders: int, world_size: int, share: Sequence[TensorMeta],
                   group_name: str, backend: str, device: torch.device, timeout_s: float, bucket_bytes: int,
                   where: str, lone_bytes: Optional[int] = None) -> WeightGroup:
    """Sender ``rank`` joins: puts its share's manifest (rank 0 also the plan settings), waits
    for every sender and receiver, forms the backends. Returns the formed group."""
    group = WeightGroup(store, rank=rank, world_size=world_size, group_name=group_name, backend=backend, device=device,
                        timeout_s=timeout_s, where=where)
    group.put("sender", metas_to_json(share))
    if rank == 0:
        group.put(PLAN_KEY, {"num_senders": num_senders, "bucket_bytes": bucket_bytes, "lone_bytes": lone_bytes})
    manifests = {r: metas_from_json(v) for r, v in group.collect("sender", range(num_senders), who="trainer").items()}
    holdings = {r: v["experts"] for r, v in group.collect(
        "receiver", range(num_senders, world_size), who="inference (orchestrator: /init_weights_update_group)").items()}
    group.form(manifests, holdings, bucket_bytes, lone_bytes)
    return group


class BroadcastReceiver:
    """Inference side: join on /init_weights_update_group, receive on /update_weights_from_distributed.

    ``experts`` (None: all) are the routed experts this worker holds; buckets of other
    experts are never sent to it. Construction blocks until the group is formed.
    """

    def __init__(self, *, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                 backend: str, timeout_s: float, device: torch.device | str = "cpu",
                 experts: Optional[Sequence[int]] = None, num_threads: int = 2):
        where = f"{master_address}:{master_port}"
        try:
            store = dist.TCPStore(master_address, int(master_port), None, False,
                                  timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, dist.DistError) as e:
            raise TimeoutError(f"inference rank {rank}: cannot reach the weight group's store at {where} (trainer "
                               f"rank 0) within {timeout_s:.0f}s: {str(e).strip().splitlines()[0]}") from e
        self.group = WeightGroup(store, rank=rank, world_size=world_size, group_name=group_name, backend=backend,
                                 device=torch.device(device), timeout_s=timeout_s, where=where)
        self.group.put("receiver", {"experts": None if experts is None else sorted(int(e) for e in experts)})
        k, bucket_bytes, lone_bytes = self.group.plan_config()
        manifests = {r: metas_from_json(v) for r, v in self.group.collect("sender", range(k), who="trainer").items()}
        holdings = {r: v["experts"] for r, v in self.group.collect("receiver", range(k, world_size),
                                                                     who="inference").items()}
        plan = self.group.form(manifests, holdings, bucket_bytes, lone_bytes)
        self.mine = [b for b in plan if rank in b.receivers]
        self.regions: dict[int, int] = {}
        total = 0
        for b in self.mine:
            self.regions[b.index] = total
            total += -(-b.nbytes // ALIGN) * ALIGN
        self.staging = torch.empty(total, dtype=torch.uint8, device=self.group.device)  # preallocated once
        self.hasher = Hasher(num_threads)
        self.metas = {e.name: e for b in self.mine for e in b.entries}

    def receive(self, version: int, announced: Optional[Sequence[TensorMeta]] = None) -> tuple[dict, int, float]:
        """Receive weights ``version``; returns ({name: tensor view of staging}, bytes, seconds).

        Raises WeightLoadError (after every posted bucket has landed) on a bad header, a
        checksum mismatch or a tensor that disagrees with ``announced``.
        """
        t0 = time.perf_counter()
        posted = []
        for b in self.mine:
            header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.group.device)
            start = self.regions[b.index]
            region = self.staging[start: start + b.nbytes].view(dtype_from_name(b.dtype))
            posted.append((b, header, region, self.group.broadcast(header, b), self.group.broadcast(region, b)))
        errors, checks = [], []
        for b, header, region, wh, wd in posted:
            self.group.wait(wh, f"receiving the header of bucket {b.index} of v{version} from trainer rank {b.sender}")
            self.group.wait(wd, f"receiving bucket {b.index} of v{version} from trainer rank {b.sender}")
            magic, v, idx, n, hi, lo = header.tolist()
            if (magic, v, idx, n) != (MAGIC, version, b.index, b.nbytes):
                errors.append(f"bucket {b.index} header says version {v}, bucket {idx}, {n} bytes; expected "
                              f"version {version}, bucket {b.index}, {b.nbytes} bytes")
            checks.append((b, digest_from_int64(hi, lo), self.hasher.submit(buffer_checksum, region)))
        for b, want, fut in checks:
            if fut.result() != want:
                errors.append(f"bucket {b.index} ({len(b.entries)} {b.dtype} tensors from trainer rank {b.sender}, "
                              f"e.g. {b.entries[0].name}) fails its checksum: {fut.result()} != {want} announced")
        if announced is not None:
            errors += self._check_announced(announced)
        if errors:
            raise WeightLoadError(f"broadcast of v{version} refused: " + "; ".join(errors[:3])
                                  + (f" (+{len(errors) - 3} more)" if len(errors) > 3 else ""))
        state = {}
        for b, _, region, _, _ in posted:
            for e, off in zip(b.entries, b.offsets()):
                n = 1
                for d in e.shape:
                    n *= d
                state[e.name] = region[off: off + n].view(e.shape)
        nbytes = sum(b.nbytes for b in self.mine)
        return state, nbytes, time.perf_counter() - t0

    def _check_announced(self, announced: Sequence[TensorMeta]) -> list[str]:
        by_name = {m.name: m for m in announced}
        errors = []
        for name, m in self.metas.items():
            a = by_name.get(name)
            if a is None:
                errors.append(f"tensor {name} arrived but /update_weights_from_distributed did not announce it")
            elif (a.dtype, tuple(a.shape)) != (m.dtype, m.shape):
                errors.append(f"tensor {name}: announced {a.dtype}{list(a.shape)}, sent {m.dtype}{list(m.shape)}")
        return errors

    def close(self) -> None:
        self.group.close()
        self.hasher.close()
