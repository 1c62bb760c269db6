"""The weight-exchange interfaces (torch side) and what every transport shares.

Each transport is a package under workers/weights/ (``filesystem``, ``broadcast``, or a
plugin's) registered in ``TRANSPORTS`` by ``weights.transport`` (workers/weights/spec.py);
its protocol is written in that package's docstring. This module holds no transport: only
the interfaces they implement and the pieces they share, so it imports none of them.

Trainer side: every rank calls ``publisher.publish(version, weights)`` with the same
:class:`~workers.weights.stream.WeightStream` of full HF-named tensors (gathered one at a time
as the publisher iterates it: every rank iterates it whole, in the same order) and gets
:class:`SyncStats` back (rank 0's go to metrics.jsonl as weight_sync_s,
weight_sync_gbps, weight_bytes). Inference side: a :class:`WeightReceiver` returns verified
tensors as :class:`Received` (or raises :class:`WeightLoadError`, old weights untouched) and
the engine copies them in. Every transport ships step 0 as a filesystem step
(``weights/step_0``): workers boot from a checkpoint on disk, as SGLang servers do.
"""
from __future__ import annotations

import abc
import dataclasses
import logging
import pickle
import re
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from workers.common.protocol import BATCH_POLL_S, wait_for

EXPERT = re.compile(r"\.experts\.(\d+)\.")


class WeightLoadError(RuntimeError):
    """A weight update is missing, partial, corrupt or does not fit the model; nothing was applied."""


class NonFiniteWeights(RuntimeError):
    """The trainer's weights hold NaN or inf: the step is not published (the message names the
    tensor and the step). Raised on every trainer rank alike, so the run stops with this reason
    unless ``weights.skip_nonfinite`` asks to skip the step instead."""


def nonfinite_message(version: int, names: list[str]) -> str:
    """The one error line for a refused step (names sorted, the first in full)."""
    more = f" (and {len(names) - 1} more tensors)" if len(names) > 1 else ""
    return (f"weights step {version} not published: tensor {names[0]} holds NaN or inf{more}; "
            f"the optimizer diverged (check trainer.lr and the loss), or set weights.skip_nonfinite=true "
            f"to skip such steps")


def refuse_nonfinite(version: int, bad: Sequence[str], *, skip: bool, peers: Optional["Peers"] = None) -> bool:
    """Every publisher's NaN/inf rule: True when ``version`` is to be skipped, raises
    :class:`NonFiniteWeights` unless ``skip`` (weights.skip_nonfinite). ``bad``: the tensors this
    rank found non-finite; with ``peers`` they are gathered first, so every rank decides the same
    (a publisher that already gathered them passes none)."""
    if peers is not None and peers.world_size > 1:
        bad = [n for part in peers.all_gather_object(list(bad)) for n in part]
    if not bad:
        return False
    message = nonfinite_message(version, sorted(bad))
    if not skip:
        raise NonFiniteWeights(message)
    logging.getLogger("slurmrl.weights").warning("%s (skipped: weights.skip_nonfinite=true)", message.split(";")[0])
    return True


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
    def publish(self, version: int, weights) -> SyncStats:
        """Make ``weights`` available to inference as weights version ``version``. ``weights``: a
        WeightStream (what the trainer passes; its ``items`` is collective on a sharded model, so
        every rank iterates the same names in the same order) or a full state dict (tools, tests:
        ``stream.as_stream`` wraps it)."""

    def wait(self, ready: Callable[[], bool], *, timeout_s: float, what: str) -> None:
        """Block until ``ready()`` (the trainer waiting for its next batch). COLLECTIVE: every trainer
        rank calls it. A transport that must act while the trainer idles (the broadcast group re-formed
        for revived workers) overrides it; by default a plain poll."""
        wait_for(ready, timeout_s=timeout_s, what=what, peer="orchestrator", poll_s=BATCH_POLL_S)

    def close(self) -> None:
        """Release threads and process groups (idempotent)."""


@dataclasses.dataclass
class Received:
    """One update as a receiver verified it, ready to be copied into the model."""

    state: dict[str, torch.Tensor]
    """The tensors to apply (views into the receiver's staging buffer, valid until its next update)."""
    hashes: Optional[dict[str, str]]
    """Every parameter's digest once applied (None: not known, e.g. after a broadcast)."""
    bytes: int
    seconds: float
    num_skipped: int = 0
    """Tensors not read because the worker already holds them (filesystem delta steps)."""
    patches: list = dataclasses.field(default_factory=list)
    """Sparse patches to apply in place after ``state`` is copied, in order: (parts, sum64s after,
    where) as workers.weights.delta.apply.apply_chain takes them (``weights.delta``)."""
    sums: Optional[dict[str, int]] = None
    """The sum64 of every tensor: before ``patches`` when there are any, else after this update
    (None: the transport does not keep them)."""
    digest: Optional[str] = None
    """The whole-model digest to report once applied, when the transport knows it (patch steps:
    of the sum64s); None: the engine computes it."""


class WeightReceiver:
    """Inference side of a transport: one per embedded worker, behind SGLang's weight routes
    (workers/inference/embedded/weight_routes.py parses the HTTP fields and applies what comes back).

    Each method blocks (the routes run it in a thread) and returns verified tensors, or raises
    :class:`WeightLoadError` leaving nothing applied. A route the transport does not use is
    refused with a message naming the transport (the route answers 400).
    """

    transport = "?"

    def _unused(self, route: str) -> WeightLoadError:
        return WeightLoadError(f"weights.transport={self.transport} does not use {route}")

    def load(self, path: str, *, expected: Mapping[str, torch.Tensor], known: Mapping[str, str],
             sums: Optional[Mapping[str, int]] = None) -> Received:
        """``/update_weights_from_disk``: read ``path``; ``known`` {name: hash} lists what the worker holds,
        ``sums`` {name: sum64} too (what a patch step needs to find its base)."""
        raise self._unused("/update_weights_from_disk")

    def join(self, *, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
             backend: str) -> None:
        """``/init_weights_update_group``: become rank ``rank`` of the weight group (blocks until it formed)."""
        raise self._unused("/init_weights_update_group")

    def receive(self, version: int, announced: Sequence[TensorMeta], *, group_name: str,
                expected: Mapping[str, torch.Tensor]) -> Received:
        """``/update_weights_from_distributed``: receive ``version`` over the joined group."""
        raise self._unused("/update_weights_from_distributed")

    def leave(self, group_name: str) -> None:
        """``/destroy_weights_update_group``."""
        raise self._unused("/destroy_weights_update_group")

    def close(self) -> None:
        """Release threads and groups (idempotent)."""


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


def peers_for(rank: int, world_size: int) -> Peers:
    """The trainer's peers for publishing: its default group, or itself alone."""
    peers: Peers = DistPeers() if world_size > 1 else SoloPeers()
    assert (peers.rank, peers.world_size) == (rank, world_size), ((peers.rank, peers.world_size), (rank, world_size))
    return peers


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


def check_fits(tensors: Mapping[str, Mapping], expected: Mapping[str, torch.Tensor], *, where: str) -> None:
    """Names and shapes of an update ({name: {"shape": ...}}) against the model's parameters."""
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise WeightLoadError(f"{where} lacks {len(missing)} model tensors, e.g. {missing[:3]}")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise WeightLoadError(f"{where} has {len(extra)} tensors the model does not, e.g. {extra[:3]}")
    for name, cur in expected.items():
        if list(tensors[name]["shape"]) != list(cur.shape):
            raise WeightLoadError(f"tensor {name}: published shape {tuple(tensors[name]['shape'])} != model shape "
                                  f"{tuple(cur.shape)} (in {where})")
