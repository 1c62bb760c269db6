"""Schema of model family ``gemma3_text``: Gemma 3's text decoder exactly as transformers' Gemma3ForCausalLM.

Interleaved local/global attention (``layer_types``: sliding-window layers with their own rotary base
``rope_local_base_freq``, full layers with ``rope_theta`` and optional linear rotary scaling), GQA with
per-head q/k RMSNorm, four norms per layer (input, post-attention, pre- and post-feedforward), the
GELU-tanh gated MLP, attention scores scaled by ``query_pre_attn_scalar ** -0.5`` instead of
``head_dim ** -0.5``, embeddings multiplied by sqrt(hidden_size), and Gemma's RMSNorm ``x * (1 + w)``.
Each field's docstring names its config.json key (workers/models/gemma3_text/spec.py maps them
both ways). Torch-free.
"""
from __future__ import annotations

import dataclasses

from workers.common.config.ranges import ge, gt, limits
from workers.models import layer_types as lt
from workers.models.blocks.decoder_config import DecoderConfig


@dataclasses.dataclass(kw_only=True)
class Gemma3TextConfig(DecoderConfig):
    """Gemma 3 text (HF Gemma3TextConfig names in parentheses; the base fields map to ``vocab_size``,
    ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
    ``max_position_embeddings``, ``rms_norm_eps``, ``tie_word_embeddings``; ``rope_theta`` is the
    full-attention layers' rotary base)."""

    family: str = "gemma3_text"
    """Model family (workers/models registry): chooses the schema of this section and the code that builds it."""
    tie_word_embeddings: bool = True
    """The output projection is the input embedding (``tie_word_embeddings``; every Gemma 3 checkpoint ties)."""
    rope_theta: float = 1_000_000.0
    """Rotary base of the full-attention layers (``rope_theta``, or ``rope_parameters.full_attention.rope_theta``)."""
    head_dim: int = 256
    """Width of one attention head (``head_dim``), free of hidden/heads (Gemma 3 1B: 256 on hidden 1152 with
    4 heads); must be even (rotary embedding)."""
    dense_intermediate_size: int = 0
    """Hidden width of every layer's GELU-tanh gated MLP (``intermediate_size``); must be > 0."""
    query_pre_attn_scalar: int = 256
    """Attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` (``query_pre_attn_scalar``)."""
    sliding_window: int = 4096
    """Keys a sliding-window layer's query sees, itself included (``sliding_window``; Gemma 3 1B: 512)."""
    layer_types: list[str] = dataclasses.field(default_factory=list)
    """``sliding_attention`` or ``full_attention`` per layer (``layer_types``; older config.json files give
    ``sliding_window_pattern`` 6: every 6th layer full). One entry per layer."""
    rope_local_base_freq: float = 10_000.0
    """Rotary base of the sliding-window layers (``rope_local_base_freq``, or
    ``rope_parameters.sliding_attention.rope_theta``)."""
    rope_linear_factor: float = 1.0
    """Linear rotary scaling of the full-attention layers (``rope_scaling: {rope_type: linear, factor}``, as
    the 4B-27B checkpoints' text configs set 8); 1: none."""

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim

    def is_sliding(self, i: int) -> bool:
        return self.layer_types[i] == lt.SLIDING


limits(Gemma3TextConfig, head_dim=gt(0), dense_intermediate_size=gt(0), query_pre_attn_scalar=gt(0),
       sliding_window=ge(0), layer_types=lt.RULE, rope_local_base_freq=gt(0), rope_linear_factor=ge(1))
