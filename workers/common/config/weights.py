"""Weights section: how trained weights reach inference (``weights/`` Hydra group)."""
from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, Optional

from omegaconf import MISSING


@dataclasses.dataclass(kw_only=True)
class WeightsConfig:
    transport: str = "filesystem"
    """``filesystem`` (run_dir/weights/step_N) or ``broadcast`` (torch.distributed)."""
    keep_last: int = 3
    """Published weight steps kept on disk (older ones are deleted, unless a kept delta step
    still points at their files)."""
    delta: bool = False
    """Filesystem: write only tensors whose checksum changed since the previous step; index.json
    points unchanged ones at the earlier file (frozen layers then cost nothing per step)."""
    delta_full_every: int = 10
    """Filesystem delta mode: every this many steps a full step is written, bounding how far back
    a step's files may lie (and so what retention must keep)."""
    num_hash_threads: int = 2
    """Threads that checksum tensors while they are written, read or broadcast."""
    bucket_size_mb: int = 64
    """Broadcast: bucket size in MiB; smaller tensors of one dtype and one receiver set are packed
    into buckets up to this. Several buckets let checksums and packing overlap the transfer; each
    broadcast also costs ~1 ms of fixed overhead on gloo (benchmarks/weight_sync.py)."""
    lone_tensor_mb: int = 16
    """Broadcast: tensors of this many MiB or more travel alone, straight from their own memory
    (no packing copy)."""
    broadcast_timeout_s: float = 300.0
    """Broadcast: deadline of forming the group and of each update (the orchestrator's request,
    every bucket); the error names the peer that did not show up."""
    backend: str = "auto"
    """Broadcast: ``auto`` (NCCL when the trainer has CUDA, else gloo), ``gloo`` or ``nccl``."""
    group_name: str = "slurmrl_weights"
    """Broadcast: SGLang's ``group_name`` of the weight-update group."""
    verify: bool = False
    """End-to-end check of every update: the orchestrator compares the trainer's whole-model digest
    (index.json; broadcast: offer.json, one hash pass on trainer rank 0) with the one each embedded
    worker reports after applying; counts land in metrics.jsonl (weight_updates_verified /
    weight_updates_mismatched). Only when trainer and inference dtypes match."""
