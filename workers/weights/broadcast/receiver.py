"""Broadcast transport, inference side: join the group, post a receive for every bucket, verify.

The protocol is in the package docstring (workers/weights/broadcast/__init__.py).
:class:`BroadcastReceiver` is one member's receiving half; :class:`GroupReceiver` puts it
behind SGLang's group routes and hands ``/update_weights_from_disk`` steps (step 0, a
revived worker) to the filesystem transport's receiver (reached through the registry: no import).
"""
from __future__ import annotations

import datetime
import time
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from workers.common.registry import TRANSPORTS
from workers.weights.base import Received, TensorMeta, WeightLoadError, WeightReceiver, check_fits
from workers.weights.broadcast.delta_wire import PatchReceiver
from workers.weights.broadcast.group import HEADER_LEN, MAGIC, WeightGroup, metas_from_json
from workers.weights.checksums import Hasher, buffer_checksum, digest_from_int64, nonfinite_names
from workers.weights.shards import ALIGN, dtype_from_name


def _checksum_and_finite(bucket, region: torch.Tensor) -> tuple[str, list[str]]:
    """(checksum, names of tensors holding NaN/inf) of one landed bucket, in one task: the
    finiteness check reads the region right after (or, on a GPU, beside) the hash."""
    parts = []
    for e, off in zip(bucket.entries, bucket.offsets()):
        n = 1
        for d in e.shape:
            n *= d
        parts.append((e.name, region[off: off + n]))
    return buffer_checksum(region), nonfinite_names(parts)


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
        plan = self.group.form(manifests, holdings, bucket_bytes, lone_bytes, delta=self.group.delta())
        self.patches = PatchReceiver({m.name: m.dtype for ms in manifests.values() for m in ms}, experts)
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
            checks.append((b, digest_from_int64(hi, lo), self.hasher.submit(_checksum_and_finite, b, region)))
        for b, want, fut in checks:
            got, bad = fut.result()
            if bad:
                errors.append(f"tensor {bad[0]} (bucket {b.index} from trainer rank {b.sender}) holds NaN or inf")
            if got != want:
                errors.append(f"bucket {b.index} ({len(b.entries)} {b.dtype} tensors from trainer rank {b.sender}, "
                              f"e.g. {b.entries[0].name}) fails its checksum: {got} != {want} announced")
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
        self.patches.invalidate()  # the caller copies these in: digests are recomputed when a patch needs them
        return state, nbytes, time.perf_counter() - t0

    def receive_patch(self, version: int, apply_under_lock) -> tuple[int, int, float]:
        """Receive every sender's patch of ``version`` and apply it in place (delta_wire.py):
        ``apply_under_lock(fn)`` runs ``fn(params)`` where the model may change. Returns (bytes,
        elements changed, seconds); raises WeightLoadError with the weights as they were."""
        t0 = time.perf_counter()
        received, nbytes = self.patches.receive(self.group, version, self.group.senders)
        changed = apply_under_lock(lambda params: self.patches.apply(params, received, version=version))
        return nbytes, changed, time.perf_counter() - t0

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


class GroupReceiver(WeightReceiver):
    """The embedded worker's receiver: the group routes, plus ``/update_weights_from_disk``
    for published filesystem steps (step 0 at boot, a revived worker) through ``disk``
    (the filesystem transport's receiver)."""

    transport = "broadcast"

    def __init__(self, *, timeout_s: float, device: torch.device | str, disk: WeightReceiver, num_threads: int = 2):
        self.disk = disk
        self.timeout_s, self.device, self.num_threads = timeout_s, torch.device(device), num_threads
        self.member: Optional[BroadcastReceiver] = None
        self.group_name: Optional[str] = None

    def join(self, *, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
             backend: str) -> None:
        if self.member is not None:
            raise WeightLoadError(f"already in weight group {self.group_name!r}: /destroy_weights_update_group first")
        self.member = BroadcastReceiver(master_address=master_address, master_port=master_port, rank=rank,
                                        world_size=world_size, group_name=group_name, backend=backend,
                                        timeout_s=self.timeout_s, device=self.device, num_threads=self.num_threads)
        self.group_name = group_name

    def _member(self, group_name: str, route: str) -> BroadcastReceiver:
        if self.member is None or self.group_name != group_name:
            raise WeightLoadError(f"not in weight group {group_name!r} (joined: {self.group_name!r})" + route)
        return self.member

    def receive(self, version: int, announced: Sequence[TensorMeta], *, group_name: str,
                expected: Mapping[str, torch.Tensor]) -> Received:
        member = self._member(group_name, ": /init_weights_update_group first")
        state, nbytes, seconds = member.receive(version, announced)  # every bucket lands, or it raises
        check_fits({n: {"shape": list(t.shape)} for n, t in state.items()}, expected, where=f"broadcast of v{version}")
        return Received(state=state, hashes=None, bytes=nbytes, seconds=seconds)

    def receive_patch(self, version: int, *, group_name: str, apply_under_lock) -> tuple[int, int, float]:
        """weights.delta: one patch version, applied in place (BroadcastReceiver.receive_patch)."""
        return self._member(group_name, ": /init_weights_update_group first").receive_patch(version, apply_under_lock)

    def load(self, *args, **kwargs):
        """A step from disk replaces the weights: the patch digests are recomputed when needed."""
        if self.member is not None:
            self.member.patches.invalidate()
        return self.disk.load(*args, **kwargs)

    def leave(self, group_name: str) -> None:
        self._member(group_name, "").close()
        self.member = self.group_name = None

    def close(self) -> None:
        if self.member is not None:
            self.member.close()
            self.member = self.group_name = None
        self.disk.close()


def make_receiver(w, *, device) -> GroupReceiver:
    """TransportSpec.receiver: joins and receives on the model's device; deadline broadcast_timeout_s. Steps on
    disk are read on the CPU by the filesystem transport's receiver (the engine copies them onto its device)."""
    disk = TRANSPORTS.get("filesystem").receiver(w, device=None)
    return GroupReceiver(timeout_s=w.broadcast_timeout_s, device=device, disk=disk, num_threads=w.num_hash_threads)
