"""The schema every pre-norm rotary decoder family shares: tiny_moe, llama, qwen3_moe and the dense
decoder of qwen3 / qwen2 / mistral (workers/models/dense/config.py) subclass it.

``DecoderConfig`` holds what the shared decoder (blocks/decoder.py, blocks/layer.py) reads beyond the
base ModelConfig: grouped-query attention, tied embeddings, rotary base, norm epsilon. Each family
adds its own fields in its home (experts for tiny_moe and qwen3_moe, a dense MLP width for llama);
the torch model takes the family's config directly. Torch-free.
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


limits(DecoderConfig, num_kv_heads=ge(0), rope_theta=gt(0), rms_norm_eps=gt(0))
