"""Schema of model family ``qwen3``: dense Qwen3 exactly as transformers' Qwen3ForCausalLM.

Per-head RMSNorm of queries and keys before rotary, a head width free of hidden/heads (Qwen3-8B:
128 on 4096 with 32 heads; Qwen3-0.6B: 128 on 1024 with 16), GQA, tied (0.6B-4B) or untied head,
and ``attention_bias`` (all four projections; off in every released checkpoint). Torch-free.
"""
from __future__ import annotations

import dataclasses

from workers.models.dense.config import DenseConfig


@dataclasses.dataclass(kw_only=True)
class Qwen3Config(DenseConfig):
    family: str = "qwen3"
    """Model family (workers/models registry): chooses the schema of this section and the code that builds it."""
    attention_bias: bool = False
    """Biases on q/k/v/o (``attention_bias``)."""

    qk_norm = True

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.attention_bias
