"""The weight-update process group and the bucket plan every member derives the same way.

Why not ``torch.distributed.init_process_group``: a trainer rank already has its default
group (the trainer's own ranks), and torch has one default group per process. The weight
group is built from ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` objects on a TCPStore of
its own (hosted by trainer rank 0), used through their methods, so it never touches the
trainer's groups. gloo and NCCL take the same calls; tensors live on the group's device.

Membership: ranks ``0..k-1`` are the trainer's senders, ``k..world-1`` the inference ranks
(``rank_offset`` of each server + its TP rank). At formation every member publishes what
it has on the store: a sender its tensors (names, dtypes, shapes of its share), a
receiver which experts it holds (None: all). From the same inputs every member computes
the same :func:`make_plan`; then each creates one backend per distinct member set
(bucket sender + the receivers that need the bucket) it belongs to, in plan order, so
creations pair up without deadlock. Every wait names the ranks still missing.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from workers.weights.base import TensorMeta, expert_id
from workers.weights.checksums import digest_int64

MAGIC = 0x57474854  # "WGHT"
HEADER_LEN = 6


def make_header(version: int, bucket: Bucket, checksum: str, device: torch.device) -> torch.Tensor:
    return torch.tensor([MAGIC, version, bucket.index, bucket.nbytes, *digest_int64(checksum)], dtype=torch.int64,
                        device=device)
"""Every bucket travels after its header: [MAGIC, version, bucket index, nbytes, checksum hi, lo]."""


PLAN_KEY = "plan"
"""Put by trainer rank 0: {num_senders, bucket_bytes, lone_bytes}, what receivers need to derive the plan."""


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Tensors of one dtype, from one sender, to one set of receivers, sent as one flat tensor."""

    index: int
    sender: int
    receivers: tuple[int, ...]
    dtype: str
    entries: tuple[TensorMeta, ...]

    @property
    def members(self) -> tuple[int, ...]:
        return tuple(sorted({self.sender, *self.receivers}))

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def offsets(self) -> list[int]:
        """Element offset of each entry in the flat bucket (entries share one dtype)."""
        out, at = [], 0
        for e in self.entries:
            out.append(at)
            at += _numel(e.shape)
        return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def holds(experts: Optional[Sequence[int]], name: str) -> bool:
    """Does a receiver holding ``experts`` (None: every expert) need tensor ``name``?"""
    e = expert_id(name)
    return e is None or experts is None or e in experts


def make_plan(manifests: dict[int, list[TensorMeta]], holdings: dict[int, Optional[list[int]]],
              bucket_bytes: int, lone_bytes: Optional[int] = None) -> list[Bucket]:
    """Buckets of every sender: per (receiver set, dtype), filled up to ``bucket_bytes``.

    A tensor of ``lone_bytes`` or more (default: more than a bucket) travels alone, sent
    from its own memory with no packing copy; a tensor no receiver holds is not sent.
    Each sender's buckets go largest first; senders' buckets are interleaved (round robin),
    so that with receivers posting every bucket up front, senders proceed in parallel.
    """
    lone_bytes = bucket_bytes + 1 if lone_bytes is None else lone_bytes
    per_sender: dict[int, list[list]] = {}
    for s in sorted(manifests):
        opened: dict[tuple, list] = {}
        order: list[list] = []
        for m in manifests[s]:
            receivers = tuple(r for r in sorted(holdings) if holds(holdings[r], m.name))
            if not receivers:
                continue
            key = (receivers, m.dtype)
            if m.nbytes >= lone_bytes:
                order.append([receivers, m.dtype, [m], m.nbytes])
                continue
            cur = opened.get(key)
            if cur is None or (cur[2] and cur[3] + m.nbytes > bucket_bytes):
                cur = opened[key] = [receivers, m.dtype, [], 0]
                order.append(cur)
            cur[2].append(m)
            cur[3] += m.nbytes
        # Largest first: the first bucket is then a lone tensor (nothing to pack before bytes
        # flow) and the last a small one (little checksum left once the transfer ends).
        per_sender[s] = sorted(order, key=lambda o: -o[3])
    plan: list[Bucket] = []
    for i in range(max((len(v) for v in per_sender.values()), default=0)):
        for s, order in per_sender.items():
            if i < len(order):
                receivers, dtype, entries, _ = order[i]
                plan.append(Bucket(len(plan), s, receivers, dtype, tuple(entries)))
    return plan


def new_backend(backend: str, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta):
    """A gloo or NCCL backend object over ``store`` (no global torch.distributed state)."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    raise ValueError(f"backend {backend!r}: the weight group runs on 'gloo' (CPU) or 'nccl' (GPU)")


def backend_for(device: torch.device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


class WeightGroup:
    """One member's view of the weight group: store, rank, plan and backends."""

    def __init__(self, store: dist.Store, *, rank: int, world_size: int, group_name: str, backend: str,
                 device: torch.device, timeout_s: float, where: str):
        self.store = dist.PrefixStore(f"slurmrl/{group_name}", store)
        self.rank, self.world_size, self.group_name = rank, world_size, group_name
        self.backend, self.device, self.timeout_s, self.where = backend, torch.device(device), timeout_s, where
        self.plan: list[Bucket] = []
        self.senders: tuple[int, ...] = ()
        self.receivers: tuple[int, ...] = ()
        self._pgs: dict[tuple[int, ...], Any] = {}

    def put(self, kind: str, value: Any) -> None:
        self.store.set(f"{kind}/{self.rank}", json.dumps(value))

    def collect(self, kind: str, ranks: Sequence[int], *, who: str) -> dict[int, Any]:
        """Every listed rank's ``kind`` value; on the deadline raise naming the ranks missing."""
        keys = [f"{kind}/{r}" for r in ranks]
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                missing = [r for r, k in zip(ranks, keys) if not self.store.check([k])]
                raise TimeoutError(f"weight group {self.group_name!r} at {self.where}: {who} ranks {missing} did not "
                                   f"join within {self.timeout_s:.0f}s (rank {self.rank} waited); see their logs")
            time.sleep(0.01)
        return {r: json.loads(self.store.get(k)) for r, k in zip(ranks, keys)}

    def plan_config(self) -> tuple[int, int, Optional[int]]:
        """(number of senders, bucket bytes, lone bytes), as trainer rank 0 put them on the store."""
        got = self.collect(PLAN_KEY, [0], who="trainer")[0]
        return int(got["num_senders"]), int(got["bucket_bytes"]), got.get("lone_bytes")

    def delta(self) -> bool:
        """Does this group carry sparse patches too (trainer rank 0's plan config)?"""
        return bool(self.collect(PLAN_KEY, [0], who="trainer")[0].get("delta"))

    def form(self, manifests: dict[int, list[TensorMeta]], holdings: dict[int, Optional[list[int]]],
             bucket_bytes: int, lone_bytes: Optional[int] = None, *, delta: bool = False) -> list[Bucket]:
        """Compute the plan and create this member's backends (blocks until peers create theirs), in
        one order every member shares: the plan's, then (``delta``) each sender with every receiver."""
        self.plan = make_plan(manifests, holdings, bucket_bytes, lone_bytes)
        self.senders, self.receivers = tuple(sorted(manifests)), tuple(sorted(holdings))
        timeout = datetime.timedelta(seconds=self.timeout_s)
        sets = [b.members for b in self.plan]
        if delta:
            sets += [tuple(sorted({s, *self.receivers})) for s in self.senders]
        for m in sets:
            if self.rank in m and m not in self._pgs:
                prefix = dist.PrefixStore("pg/" + "-".join(map(str, m)), self.store)
                self._pgs[m] = new_backend(self.backend, prefix, m.index(self.rank), len(m), timeout)
        return self.plan

    def broadcast(self, tensor: torch.Tensor, bucket: Bucket):
        """Async broadcast on the bucket's backend from its sender; returns the Work."""
        return self.broadcast_on(bucket.members, tensor, bucket.sender)

    def broadcast_on(self, members: tuple[int, ...], tensor: torch.Tensor, src: int):
        """Async broadcast from group rank ``src`` on the backend of ``members``; returns the Work."""
        opts = dist.BroadcastOptions()
        opts.rootRank = members.index(src)
        return self._pgs[members].broadcast([tensor], opts)

    def wait(self, work, what: str) -> None:
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:  # gloo raises on timeouts and on a peer that went away
            raise TimeoutError(f"weight group {self.group_name!r}: {what} failed on rank {self.rank} "
                               f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})") from e

    def close(self) -> None:
        self._pgs.clear()


def metas_to_json(metas: Sequence[TensorMeta]) -> list:
    return [[m.name, m.dtype, list(m.shape), m.nbytes] for m in metas]


def metas_from_json(rows: list) -> list[TensorMeta]:
    return [TensorMeta(n, d, tuple(s), int(b)) for n, d, s, b in rows]
