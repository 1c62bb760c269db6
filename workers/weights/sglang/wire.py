"""SGLang's weight-update wire protocol, as both ends of it must derive it (no sglang import).

The pinned sglang 0.5.23 receives weights like this (read 2026-12-03; tests/unit/
test_sglang_weight_protocol.py re-reads those files and fails when any of it changes):

- ``/init_weights_update_group`` {master_address, master_port, rank_offset, world_size,
  group_name, backend}: every server rank joins one process group at rank
  ``rank_offset + tp_rank`` (model_runner_components/weight_updater.py,
  ``WeightUpdater.init_weights_update_group``), through ``init_custom_process_group``
  (srt/utils/common.py): torch's ``rendezvous("tcp://addr:port")`` (rank 0 hosts the
  TCPStore), a ``PrefixStore(group_name, store)``, and ``_new_process_group_helper`` with
  no global ranks (the group is its own world). :func:`open_update_group` does the same
  steps, so our sender (rank 0) meets real servers and our fakes alike.
- ``/update_weights_from_distributed`` {names, dtypes, shapes, group_name, load_format,
  weight_version, flush_cache, ...} between ``/begin_weight_update`` and
  ``/end_weight_update`` (scheduler_components/weight_updater.py refuses it outside that
  session): per tensor, in the order of ``names``, ``torch.distributed.broadcast(src=0)``
  into a fresh ``torch.empty(shape, dtype)`` (``receive_weights_from_distributed``); or,
  with ``load_format="flattened_bucket"``, ONE broadcast of a uint8 buffer holding the
  tensors back to back (``FlattenedTensorBucket.empty``: byte offsets, each aligned to its
  dtype's item size). Then the model's ``load_weights`` takes them (each TP rank keeps its
  shard). No checksum: verification reads ``/get_weights_by_name`` {name, truncate_size},
  which answers ``param.float().tolist()[:truncate_size]`` (models/llama.py; only some
  model classes implement it: :data:`WEIGHTS_BY_NAME_ARCHITECTURES`).

Batches (:func:`plan_batches`): the tensors of one update, in state order, cut into calls of
at most ``bucket_bytes`` and one dtype each (so flattened offsets stay aligned), the same
on the trainer (which broadcasts) and the orchestrator (which posts the calls). Torch-free at
import (the orchestrator plans batches too); the torch helpers import it when called.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import random
from typing import Any, Sequence

FORMATS = ("flattened_bucket", "per_tensor")
"""``weights.sglang_format``: one broadcast per call, or one per tensor (SGLang's default load_format None)."""
DELTA_LOADER = "workers.weights.sglang.patch_loader.load_patch"
"""Import path of the function SGLang calls to apply a sparse patch (``--custom-weight-loader`` on the
server's command line, ``load_format`` of ``/update_weights_from_tensor``; weights.delta only)."""
WEIGHTS_BY_NAME_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
"""Those of our families' SGLang model classes that implement ``get_weights_by_name`` in 0.5.23
(srt/models/llama.py, and mistral.py's subclass of it; qwen2, qwen3, qwen3_moe, deepseek_v2, glm and
nemotron_h do not): sampled verification
works only for them (checked against the pinned source by the protocol test)."""


ITEM_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
              "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}
"""Bytes per element of the dtypes a state dict carries (torch's names without ``torch.``)."""


BULK_EFFICIENCY = 0.8
"""NCCL broadcast bus bandwidth as a fraction of NIC line rate on NDR (nccl-tests on HGX H100:
350-390 of 400 GB/s per node; tools/simulator/assumptions.py's ``bulk_efficiency`` is this value)."""


def update_cost(model_bytes: float, nic_gb_s: float, efficiency: float = BULK_EFFICIENCY) -> tuple[float, float]:
    """(bytes every inference GPU receives per update, seconds on the wire) for SGLang's protocol.

    Every server rank is a member of the one group and every broadcast reaches all members, so
    each GPU receives the whole model in inference.dtype, whatever its TP/EP share (the loader
    keeps its shard afterwards). NCCL pipelines a broadcast along a ring/tree: every link carries
    the bytes once, so the time is the model over one NIC's rate, independent of the number of
    servers. The plan prints this; tools/simulator/costs.py uses it for broadcast into SGLang.
    """
    return model_bytes, model_bytes / (nic_gb_s * 1e9 * efficiency)


@dataclasses.dataclass(frozen=True)
class Wire:
    """One tensor as both ends announce it (duck-types workers.weights.base.TensorMeta)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Batch:
    """One ``/update_weights_from_distributed`` call: these tensors, one dtype."""

    index: int
    metas: tuple[Any, ...]

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.metas)

    def body(self, *, group_name: str, load_format: str) -> dict[str, Any]:
        """SGLang's names/dtypes/shapes triple (+ group and format) for this call."""
        return {"names": [m.name for m in self.metas], "dtypes": [m.dtype for m in self.metas],
                "shapes": [list(m.shape) for m in self.metas], "group_name": group_name,
                "load_format": None if load_format == "per_tensor" else load_format}


def plan_batches(metas: Sequence[Any], bucket_bytes: int) -> list[Batch]:
    """Consecutive tensors of one dtype, up to ``bucket_bytes`` a batch (a bigger tensor alone)."""
    out: list[list[Any]] = []
    size = 0
    for m in metas:
        if not out or out[-1][0].dtype != m.dtype or size + m.nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(m)
        size += m.nbytes
    return [Batch(i, tuple(b)) for i, b in enumerate(out)]


def metas_json(metas: Sequence[Any]) -> dict[str, list]:
    return {"names": [m.name for m in metas], "dtypes": [m.dtype for m in metas],
            "shapes": [list(m.shape) for m in metas]}


def metas_from(group: dict) -> list[Wire]:
    """The update's tensors from group.json's names/dtypes/shapes."""
    return [Wire(n, d, tuple(s), math.prod(s) * ITEM_BYTES[d])
            for n, d, s in zip(group["names"], group["dtypes"], group["shapes"])]


def flat_offsets(batch: Batch) -> list[int]:
    """Byte offset of each tensor in the flattened bucket (FlattenedTensorBucket.empty's layout)."""
    out, at = [], 0
    for m in batch.metas:
        if at % ITEM_BYTES[m.dtype]:
            raise ValueError(f"unaligned tensor {m.name} at byte {at} ({m.dtype}): batches must keep one dtype")
        out.append(at)
        at += m.nbytes
    return out


def sample_names(names: Sequence[str], fraction: float, version: int) -> list[str]:
    """The tensors verified after update ``version``: ``ceil(fraction * n)`` of them, a different
    draw each version (seeded by it), so over a run every tensor is read back."""
    if fraction <= 0 or not names:
        return []
    k = min(len(names), max(1, math.ceil(fraction * len(names))))
    return sorted(random.Random(version).sample(list(names), k))


def sample_value(t, rows: int) -> list:
    """What ``/get_weights_by_name`` answers for tensor ``t`` with truncate_size ``rows``."""
    import torch

    return t.detach().cpu().to(torch.float32).numpy().tolist()[:rows]


def open_update_group(*, backend: str, master_address: str, master_port: int, world_size: int, rank: int,
                      group_name: str, timeout_s: float):
    """Join (rank 0: host) the weight-update group the way SGLang's ``init_custom_process_group``
    does: tcp rendezvous -> PrefixStore(group_name) -> a process group that is its own world.

    Why torch's private ``_new_process_group_helper``: it is what the receiving side calls, and
    the store keys both sides use must match. One process can hold a group name only once.
    """
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                    rendezvous)

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      backend_options=None, timeout=timeout, device_id=None)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def close_update_group(pg) -> None:
    import torch.distributed as dist

    try:
        dist.destroy_process_group(pg)
    except Exception:  # noqa: BLE001 - already gone (the peer closed it): nothing to release
        pass
