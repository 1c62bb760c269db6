"""The weight-exchange interface: trainer ranks publish, inference workers receive and apply.

Two transports sit behind it, chosen by ``weights.transport``:

- ``filesystem`` (:mod:`workers.weights.filesystem`): every trainer rank writes a share of
  the tensors as safetensors into ``run_dir/weights/step_N/``; rank 0 adds index.json and
  STABLE; workers load it on ``/update_weights_from_disk``.
- ``broadcast`` (:mod:`workers.weights.broadcast`): trainer ranks 0..k-1 and every inference
  rank form one torch.distributed group (gloo on CPU, NCCL on GPU); buckets travel on
  ``/update_weights_from_distributed``. Step 0 still goes through the filesystem: workers
  start from a checkpoint on disk, as SGLang servers do.

Trainer side: every rank calls ``publisher.publish(version, state)`` with the full HF-named
state dict and gets :class:`SyncStats` back (rank 0's go to metrics.jsonl as weight_sync_s,
weight_sync_gbps, weight_bytes). Inference side: the transport returns verified tensors
(or raises :class:`WeightLoadError`, old weights untouched) and the engine copies them in.
"""
from __future__ import annotations

import abc
import dataclasses
import pickle
import re
from typing import Any, Mapping, Optional, Sequence

import torch

EXPERT = re.compile(r"\.experts\.(\d+)\.")


class WeightLoadError(RuntimeError):
    """A weight update is missing, partial, corrupt or does not fit the model; nothing was applied."""


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """What both sides must agree on for one tensor (SGLang's names/dtypes/shapes triple)."""

    name: str
    dtype: str
    """torch dtype name without ``torch.`` (``float32``, ``bfloat16``)."""
    shape: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> "TensorMeta":
        return cls(name, str(t.dtype).replace("torch.", ""), tuple(t.shape), t.numel() * t.element_size())


@dataclasses.dataclass
class SyncStats:
    """One update as one rank saw it; ``metrics()`` is what the trainer logs per step."""

    bytes: int
    seconds: float
    wait_s: float = 0.0
    """Time spent waiting for the peer (broadcast: for the orchestrator's request), not moving bytes."""
    skipped: bool = False
    """Nothing was sent (broadcast after the orchestrator finished: nobody receives)."""

    @property
    def gbps(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9

    def metrics(self) -> dict[str, Any]:
        return {"weight_sync_s": self.seconds, "weight_sync_gbps": self.gbps, "weight_bytes": self.bytes,
                "weight_sync_wait_s": self.wait_s, "weight_sync_skipped": int(self.skipped)}


class WeightPublisher(abc.ABC):
    """Trainer side of a transport. ``publish`` is collective: every trainer rank calls it."""

    @abc.abstractmethod
    def publish(self, version: int, state: Mapping[str, torch.Tensor]) -> SyncStats:
        """Make ``state`` available to inference as weights version ``version``."""

    def close(self) -> None:
        """Release threads and process groups (idempotent)."""


class Peers(abc.ABC):
    """The trainer ranks taking part in a publish, and the one collective publishing needs."""

    rank: int
    world_size: int

    @abc.abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (a barrier as well)."""


class SoloPeers(Peers):
    rank, world_size = 0, 1

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]


class DistPeers(Peers):
    """The trainer's default torch.distributed group (gloo, or NCCL with the device set)."""

    def __init__(self):
        import torch.distributed as dist

        self._dist = dist
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj)
        return out


class StorePeers(Peers):
    """Ranks that share a torch.distributed Store but no process group (threads in a test,
    or processes before a group exists). Each gather waits at most ``timeout_s``."""

    def __init__(self, store, rank: int, world_size: int, *, prefix: str = "peers", timeout_s: float = 60.0):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.prefix, self.timeout_s, self._seq = prefix, timeout_s, 0

    def all_gather_object(self, obj: Any) -> list[Any]:
        import datetime

        self._seq += 1
        keys = [f"{self.prefix}/{self._seq}/{r}" for r in range(self.world_size)]
        self.store.set(keys[self.rank], pickle.dumps(obj))
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:
            raise TimeoutError(f"trainer rank {self.rank}: not every rank of {self.world_size} reached publish "
                               f"gather {self._seq} within {self.timeout_s:.0f}s ({e})") from None
        return [pickle.loads(self.store.get(k)) for k in keys]


def assign_shares(metas: Sequence[TensorMeta], num_ranks: int) -> list[list[TensorMeta]]:
    """Split tensors over ranks by bytes (largest first onto the lightest rank).

    Deterministic from names and shapes alone, so every rank computes the same split
    without talking, and it stays the same from step to step (delta mode relies on it).
    Each share keeps the state dict's order.
    """
    loads = [0] * num_ranks
    owner: dict[str, int] = {}
    for m in sorted(metas, key=lambda m: (-m.nbytes, m.name)):
        r = min(range(num_ranks), key=lambda i: (loads[i], i))
        owner[m.name] = r
        loads[r] += m.nbytes
    return [[m for m in metas if owner[m.name] == r] for r in range(num_ranks)]


def expert_id(name: str) -> Optional[int]:
    """Routed-expert index of an HF parameter name (``...mlp.experts.7.up_proj.weight`` -> 7)."""
    m = EXPERT.search(name)
    return int(m.group(1)) if m else None


def make_publisher(cfg, paths, topology, *, rank: int, world_size: int,
                   device: Optional[torch.device] = None) -> WeightPublisher:
    """The configured transport's publisher for this trainer rank (call on every rank).

    ``cfg`` is the RunConfig, ``paths`` its RunPaths, ``topology`` this rank's Topology
    (its weights_group_addr / master_addr say where the broadcast group's store listens).
    """
    from workers.weights.filesystem import FilesystemPublisher

    peers: Peers = DistPeers() if world_size > 1 else SoloPeers()
    assert (peers.rank, peers.world_size) == (rank, world_size), ((peers.rank, peers.world_size), (rank, world_size))
    w = cfg.weights
    fs = FilesystemPublisher(paths.root / "weights", peers=peers, keep_last=w.keep_last, delta=w.delta,
                             full_every=w.delta_full_every, num_threads=w.num_hash_threads)
    if w.transport == "filesystem":
        return fs
    if w.transport == "broadcast":
        # inference.backend=sglang with broadcast is refused by the plan (launcher/sglang_checks.py)
        from workers.weights.broadcast import BroadcastPublisher
        from workers.weights.handshake import receiver_rank_counts

        host, port = topology.master_addr, 0
        if topology.weights_group_addr:
            host, _, p = topology.weights_group_addr.rpartition(":")
            port = int(p)
        return BroadcastPublisher(paths, w, peers, initial=fs, host=host, port=port,
                                  num_receivers=sum(receiver_rank_counts(cfg)), device=device)
    raise ValueError(f"weights.transport={w.transport!r} is not one of ['filesystem', 'broadcast']")
