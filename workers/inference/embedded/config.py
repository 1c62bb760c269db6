"""Options of the embedded backend (``inference=embedded``): the engine's device and threads,
admission and connection limits of its HTTP server."""
from __future__ import annotations

import dataclasses

from workers.common.config.inference import InferenceConfig
from workers.common.config.ranges import Pattern, ge, gt, limits, one_of


@dataclasses.dataclass(kw_only=True)
class EmbeddedInferenceConfig(InferenceConfig):
    """The embedded engine: one process per worker, continuous batching on CPU or one GPU."""

    backend: str = "embedded"
    """``embedded``: this schema's backend."""
    device: str = "cpu"
    """Torch device of the embedded engine: ``cpu``, ``cuda`` or ``cuda:N`` (one GPU may be shared with the trainer).
    Local runs give each engine on ``cuda`` a GPU of its own, seen as cuda:0 inside it (launcher/gpus.py)."""
    num_threads: int = 1
    """torch intra-op threads per worker (2 cores are shared by all roles locally)."""
    max_queued_requests: int = 256
    """Prompts a worker holds waiting for a batch slot (beyond the ``max_batch_size`` running);
    more are answered 429 with Retry-After and the orchestrator's client backs off and retries
    within its deadline. Bounds how long a burst can delay the next request (the default is
    4x orchestrator.max_inflight_rollouts' default, so a normal run never sees a 429)."""
    static_cache: str = "auto"
    """Engine kind: ``auto`` (the static engine on CUDA, the dynamic one on CPU), ``on`` (static on
    any device; CUDA graphs only on CUDA) or ``off`` (dynamic: KV cache grown per step). Every builtin
    family fits the static slots (GQA k/v, MLA latent + DSA index keys, Mamba-2 state); a model whose
    layer holds two attention/mixer modules uses the dynamic engine (a log line says so)."""
    max_seq_len: int = 0
    """Static engine: positions per KV slot (prompt + output); 0: model.max_position_embeddings, the
    dynamic engine's limit. The cache holds ``max_batch_size x max_seq_len`` positions per layer,
    allocated at start: lower it for long-context models (longer prompts are then refused with
    400, longer outputs end with finish_reason length)."""
    prefill_chunk: int = 512
    """Static engine: prompt positions prefilled per forward (longer prompts take several)."""
    sync_every: int = 8
    """Static engine: decode steps between two reads of the finished flags by the host (a
    finished request waits at most this many steps; new requests are admitted at these points)."""
    cuda_graphs: bool = True
    """Static engine on CUDA: replay decode steps as CUDA graphs (one per batch size)."""
    idle_timeout_s: float = 75.0
    """Seconds an open connection may sit without a request (keep-alive idle, or a client
    that connected and sent nothing); also the deadline for a request body to arrive. TCP
    keep-alive probes close half-open connections (a peer gone without a FIN) within ~90 s."""


limits(EmbeddedInferenceConfig, device=Pattern(r"cpu|cuda(:\d+)?", "cpu, cuda or cuda:N (N a GPU index)"),
       num_threads=gt(0), max_queued_requests=gt(0), idle_timeout_s=gt(0),
       static_cache=one_of("auto", "on", "off"), max_seq_len=ge(0), prefill_chunk=gt(0), sync_every=gt(0))
