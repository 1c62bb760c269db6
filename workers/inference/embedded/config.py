"""Options of the embedded backend (``inference=embedded``): the engine's device and threads."""
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


limits(EmbeddedInferenceConfig, device=Pattern(r"cpu|cuda(:\d+)?", "cpu, cuda or cuda:N (N a GPU index)"),
       num_threads=gt(0))
