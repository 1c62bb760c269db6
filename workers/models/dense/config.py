"""The schema of the dense rotary decoders (Qwen3, Qwen2 / Qwen2.5, Mistral): one decoder, per-family switches.

What differs between these families is a handful of attention switches (workers/models/blocks/attention.py),
fixed by the architecture, not by a checkpoint: Qwen3 has per-head q/k RMSNorm (and ``attention_bias``
on all four projections when its config sets it), Qwen2 has q/k/v biases, Mistral neither. Those are
class-level properties of each family's subclass, so a config can never describe, say, a Qwen2
without its biases (its published config.json would then load into a different function).

What a checkpoint chooses are fields: a head width free of hidden/heads (``head_dim``), the MLP width,
and sliding-window attention: ``sliding_window`` keys for the layers ``layer_types`` marks
``sliding_attention`` (every layer when ``layer_types`` is empty). Torch-free.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from workers.common.config.ranges import Each, ge, gt, limits, one_of
from workers.models.blocks.decoder_config import DecoderConfig

FULL, SLIDING = "full_attention", "sliding_attention"
"""transformers' ``layer_types`` values."""


@dataclasses.dataclass(kw_only=True)
class DenseConfig(DecoderConfig):
    """A dense pre-norm decoder: GQA attention (switches per family) and a SwiGLU MLP in every layer."""

    head_dim: int = 0
    """Width of one attention head (``head_dim``); 0: hidden_size / num_heads. Must be even (rotary embedding)."""
    dense_intermediate_size: int = 0
    """Hidden width of every layer's SwiGLU MLP (``intermediate_size``); must be > 0."""
    sliding_window: int = 0
    """Sliding-window attention: a query sees its last ``sliding_window`` keys (itself included;
    transformers' rule) in the layers ``layer_types`` marks sliding; 0: every layer attends to all
    earlier keys (``sliding_window``; Qwen2/3 only with ``use_sliding_window: true``)."""
    layer_types: list[str] = dataclasses.field(default_factory=list)
    """Per layer ``full_attention`` or ``sliding_attention`` (``layer_types``; Qwen2/3 derive it from
    ``max_window_layers``); empty: every layer sliding when ``sliding_window`` > 0, else every layer full."""

    qk_norm = False
    """Per-head RMSNorm of queries and keys before rotary (Qwen3): fixed by the family."""

    @property
    def qkv_bias(self) -> bool:
        """Biases on q/k/v (Qwen2: always; Qwen3: ``attention_bias``)."""
        return False

    @property
    def o_bias(self) -> bool:
        """A bias on o_proj (Qwen3's ``attention_bias``)."""
        return False

    @property
    def attention_head_dim(self) -> int:
        """The head width the model uses (``head_dim``, or hidden_size / num_heads when 0)."""
        return self.head_dim or self.hidden_size // self.num_heads

    def layer_window(self, i: int) -> Optional[int]:
        """Layer i's sliding window (None: full attention)."""
        if not self.sliding_window or (self.layer_types and self.layer_types[i] != SLIDING):
            return None
        return self.sliding_window

    @property
    def sliding_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.layer_window(i) is not None]


limits(DenseConfig, head_dim=ge(0), dense_intermediate_size=gt(0), sliding_window=ge(0),
       layer_types=Each(one_of(FULL, SLIDING)))
