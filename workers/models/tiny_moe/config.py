"""Schemas of the decoder families built by workers/models/tiny_moe/model.py: tiny_moe and llama.

``DecoderConfig`` holds what the torch model reads beyond the base ModelConfig (grouped-query
attention, tied embeddings, rotary base, norm epsilon); ``TinyMoeConfig`` adds the routed
experts. The dense Llama variant (workers/models/llama/config.py) adds a dense MLP width instead.
The torch model takes either directly (no copying into another dataclass); a field one of them
lacks is refused when the config is composed or loaded, with the field named. Torch-free.
"""
from __future__ import annotations

import dataclasses

from workers.common.config.model import ModelConfig
from workers.common.config.ranges import ge, gt, limits

INIT_STD = 0.02
"""Standard deviation of the seeded init (residual projections are scaled down by sqrt(2 * layers))."""


@dataclasses.dataclass(kw_only=True)
class DecoderConfig(ModelConfig):
    """A pre-norm decoder with rotary (GQA) attention and SwiGLU MLPs, HF Llama/Qwen3-MoE names."""

    num_kv_heads: int = 0
    """Key/value heads (grouped-query attention, config.json ``num_key_value_heads``); 0: num_heads.
    Must divide num_heads."""
    tie_word_embeddings: bool = False
    """The output projection is the input embedding, no ``lm_head.weight`` of its own (``tie_word_embeddings``)."""
    rope_theta: float = 10000.0
    """Rotary embedding base (``rope_theta``, or ``rope_parameters.rope_theta`` as transformers 5 writes it)."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon (``rms_norm_eps``)."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def is_dense(self) -> bool:
        return self.num_experts == 0

    @property
    def init_std(self) -> float:
        """Std of the seeded init (a subclass may scale it: tests/plugins/models_plugin.py)."""
        return INIT_STD


@dataclasses.dataclass(kw_only=True)
class TinyMoeConfig(DecoderConfig):
    """tiny_moe: every layer a top-k routed Mixture-of-Experts MLP (HF Qwen3-MoE names)."""

    family: str = "tiny_moe"
    """Model family (workers/models registry): chooses the schema of this section and the code that builds it."""
    num_experts: int = 8
    """Routed experts per MoE layer (> 0; a dense model is ``model.family=llama``)."""
    top_k: int = 2
    """Experts chosen per token."""
    expert_intermediate_size: int = 256
    """Hidden width of each expert's SwiGLU MLP."""


limits(DecoderConfig, num_kv_heads=ge(0), rope_theta=gt(0), rms_norm_eps=gt(0))
limits(TinyMoeConfig, num_experts=gt(0), top_k=gt(0), expert_intermediate_size=gt(0))
