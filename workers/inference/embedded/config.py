"""Options of the embedded backend (``inference=embedded``): the engine's device and threads,
admission and connection limits of its HTTP server."""
from __future__ import annotations

import dataclasses

from workers.common.config.inference import InferenceConfig
from workers.common.config.ranges import Pattern, gt, limits


@dataclasses.dataclass(kw_only=True)
class EmbeddedInferenceConfig(InferenceConfig):
    """The embedded engine: one process per worker, continuous batching on CPU or one GPU."""

    backend: str = "embedded"
    """``embedded``: this schema's backend."""
    device: str = "cpu"
    """Torch device of the embedded engine: ``cpu``, ``cuda`` or ``cuda:N`` (one GPU may be shared with the trainer)."""
    num_threads: int = 1
    """torch intra-op threads per worker (2 cores are shared by all roles locally)."""
    max_queued_requests: int = 256
    """Prompts a worker holds waiting for a batch slot (beyond the ``max_batch_size`` running);
    more are answered 429 with Retry-After and the orchestrator's client backs off and retries
    within its deadline. Bounds how long a burst can delay the next request (the default is
    4x orchestrator.max_inflight_rollouts' default, so a normal run never sees a 429)."""
    idle_timeout_s: float = 75.0
    """Seconds an open connection may sit without a request (keep-alive idle, or a client
    that connected and sent nothing); also the deadline for a request body to arrive. TCP
    keep-alive probes close half-open connections (a peer gone without a FIN) within ~90 s."""


limits(EmbeddedInferenceConfig, device=Pattern(r"cpu|cuda(:\d+)?", "cpu, cuda or cuda:N (N a GPU index)"),
       num_threads=gt(0), max_queued_requests=gt(0), idle_timeout_s=gt(0))
