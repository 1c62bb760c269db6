"""What flows through the embedded engine: a request, its result, and a request in flight.

Why a module of its own: the server builds :class:`GenRequest` and formats :class:`GenOutput`
without needing the engine's batching code; engine.py re-exports both (their old home).
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Callable, Optional

import torch


@dataclasses.dataclass(kw_only=True)
class GenRequest:
    """One prompt to complete; the server builds these from SGLang's /generate fields."""

    input_ids: list[int]
    temperature: float = 1.0
    top_p: float = 1.0
    """Nucleus sampling; below 1 only the static engine honours it (the dynamic one refuses)."""
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    adapter: Optional[str] = None
    """LoRA mode: the adapter to sample with (SGLang's ``lora_path``: a name), None the first one, ``base``
    the base alone (workers/inference/embedded/lora.py); the server refuses a name it does not serve."""
    rid: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)


@dataclasses.dataclass(kw_only=True)
class GenOutput:
    rid: str
    prompt_tokens: int
    output_ids: list[int]
    logprobs: list[float]
    """log p(token) under the sampling distribution (float32 math)."""
    token_versions: list[int]
    """weight_version of the weights that produced each output token."""
    finish_reason: dict
    weight_version: int
    """Engine version when the request finished."""
    routed_experts: Optional[torch.Tensor]
    """int32 [n, L, k] for positions [routed_experts_start_len, seqlen-1), or None."""
    latency_s: float
    error: Optional[str] = None
    """Set when the engine failed (crashed, or was stopped): the server answers an error, not tokens."""


@dataclasses.dataclass(eq=False)
class _Seq:
    """A request in flight: its tokens so far plus what the response needs."""

    req: GenRequest
    on_done: Callable[[GenOutput], None]
    out_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    routed: list[torch.Tensor] = dataclasses.field(default_factory=list)  # [t, L, k] per forward fed
    t0: float = dataclasses.field(default_factory=time.perf_counter)
    adapter_id: int = 0  # LoRA mode: the adapter slot its rows use (EngineLora.index of req.adapter)

    @property
    def seqlen(self) -> int:
        return len(self.req.input_ids) + len(self.out_ids)
