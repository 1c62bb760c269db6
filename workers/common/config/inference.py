"""Inference section: what every backend's servers share (``inference/`` Hydra group).

Each backend extends :class:`InferenceConfig` in its own package with its own options
(workers/inference/embedded/config.py, workers/inference/sglang/config.py); ``inference.backend``
picks the schema (workers/common/registry.py BACKENDS), so an option the chosen backend does
not have is refused with its name.
"""
from __future__ import annotations

import dataclasses
from dataclasses import field

from omegaconf import MISSING

from workers.common.config.ranges import NONEMPTY, ge, gt, limits, one_of
from workers.common.dtypes import INFERENCE_DTYPES


@dataclasses.dataclass(kw_only=True)
class ServerLayout:
    """One inference server replica on nodes and GPUs, in SGLang's terms (--tp/--ep/--dp, --nnodes)."""

    num_nodes_per_replica: int = 1
    """Nodes one replica spans (SGLang --nnodes); one Slurm task per node."""
    num_replicas_per_node: int = 1
    """Replicas sharing one node (CPU workers, or servers using part of a node's GPUs)."""
    tp: int = 1
    """Tensor-parallel size = GPUs of one replica (SGLang --tp-size); 1 on CPU."""
    ep: int = 1
    """Expert-parallel size inside a replica (SGLang --ep-size); divides tp and model.num_experts."""
    dp_attention: int = 1
    """Data-parallel attention groups inside a replica (SGLang --attn-dp-size)."""


@dataclasses.dataclass(kw_only=True)
class InferenceConfig:
    """Fields every backend reads; a backend's schema subclasses this (and may subclass the layouts)."""

    backend: str = MISSING
    """Which backend serves: ``embedded`` (tiny-model server in this repo), ``sglang``, or a plugin's."""
    num_workers: int = 2
    """Inference server processes; the orchestrator spreads rollouts over them."""
    max_batch_size: int = 64
    """Most sequences one worker decodes together."""
    dtype: str = "float32"
    """Compute dtype of the engine: float32 | bfloat16 | float8 (embedded engine on Hopper/Blackwell: fp8
    projections and experts with block or row scales over bf16 weights, which the trainer publishes;
    docs/guide/fp8_rollouts.md)."""
    host: str = "127.0.0.1"
    """Address the servers bind to (never 0.0.0.0 by default)."""
    startup_timeout_s: float = 120.0
    """Deadline for a worker to load the step-0 weights and answer /health."""
    worker: ServerLayout = field(default_factory=ServerLayout)
    """Layout of each of the ``num_workers`` unified (prefill + decode) servers."""
    num_prefill_replicas: int = 0
    """Prefill servers of prefill/decode disaggregation (then num_workers must be 0)."""
    prefill: ServerLayout = field(default_factory=ServerLayout)
    """Layout of each prefill server."""
    num_decode_replicas: int = 0
    """Decode servers of prefill/decode disaggregation (then num_workers must be 0)."""
    decode: ServerLayout = field(default_factory=ServerLayout)
    """Layout of each decode server."""
    num_cpus_per_task: int = 1
    """Slurm CPUs of one server task (one task per replica and node)."""
    mem_gb: int = 0
    """Slurm memory per node of the server components in GB (0: the cluster default)."""


limits(ServerLayout, num_nodes_per_replica=gt(0), num_replicas_per_node=gt(0), tp=gt(0), ep=gt(0), dp_attention=gt(0))
limits(InferenceConfig, backend=NONEMPTY, num_workers=ge(0), max_batch_size=gt(0), dtype=one_of(*INFERENCE_DTYPES),
       host=NONEMPTY, startup_timeout_s=gt(0), num_prefill_replicas=ge(0), num_decode_replicas=ge(0),
       num_cpus_per_task=gt(0), mem_gb=ge(0))
