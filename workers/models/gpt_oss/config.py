"""Schema of model family ``gpt_oss``: GPT-OSS exactly as transformers' GptOssForCausalLM.

Every layer: GQA attention with biases on q/k/v/o and one learned sink logit per head, a sliding
window of ``sliding_window`` keys or full attention per ``layer_types`` (alternating in the
released models), YaRN rotary scaling; then a MoE MLP (biased router, softmax over the top-k
logits, experts with biases and the clamped SwiGLU of ``swiglu_alpha`` / ``swiglu_limit``). Each
field's docstring names its config.json key (workers/models/gpt_oss/spec.py maps them both ways).
Torch-free.
"""
from __future__ import annotations

import dataclasses

from workers.common.config.ranges import ge, gt, limits, one_of
from workers.models import layer_types as lt
from workers.models.blocks.decoder_config import DecoderConfig


@dataclasses.dataclass(kw_only=True)
class GptOssConfig(DecoderConfig):
    """GPT-OSS (HF GptOssConfig names in parentheses; the base fields map to ``vocab_size``, ``hidden_size``,
    ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``max_position_embeddings``,
    ``rms_norm_eps``, ``tie_word_embeddings``, ``rope_theta``)."""

    family: str = "gpt_oss"
    """Model family (workers/models registry): chooses the schema of this section and the code that builds it."""
    rope_theta: float = 150_000.0
    """Rotary base (``rope_theta``, or ``rope_parameters.rope_theta``)."""
    rms_norm_eps: float = 1e-5
    """RMSNorm epsilon (``rms_norm_eps``)."""
    head_dim: int = 64
    """Width of one attention head (``head_dim``), free of hidden/heads (gpt-oss-20b: 64 on hidden 2880 with
    64 heads); must be even (rotary embedding)."""
    attention_bias: bool = True
    """Biases on the q/k/v/o projections (``attention_bias``; the released models have them)."""
    num_experts: int = 8
    """Routed experts per layer (``num_local_experts``)."""
    top_k: int = 2
    """Experts chosen per token (``num_experts_per_tok``, also written ``experts_per_token``)."""
    expert_intermediate_size: int = 256
    """Hidden width of each expert's clamped SwiGLU (``intermediate_size``)."""
    swiglu_alpha: float = 1.702
    """Sigmoid gain of the experts' SwiGLU: ``gate * sigmoid(alpha * gate)`` (``swiglu_alpha``)."""
    swiglu_limit: float = 7.0
    """The gate is clamped to <= limit and the up projection to [-limit, limit] (``swiglu_limit``)."""
    sliding_window: int = 128
    """Keys a sliding-window layer's query sees, itself included (``sliding_window``)."""
    layer_types: list[str] = dataclasses.field(default_factory=list)
    """``sliding_attention`` or ``full_attention`` per layer (``layer_types``; absent from config.json:
    alternating, even layers sliding). One entry per layer."""
    rope_scaling: str = "yarn"
    """Rotary scaling (``rope_parameters.rope_type``): ``yarn`` (the released models) or ``default``."""
    rope_factor: float = 32.0
    """YaRN context extension factor (``rope_parameters.factor``)."""
    rope_original_max_position_embeddings: int = 4096
    """Context the rotary frequencies were trained for (``rope_parameters.original_max_position_embeddings``)."""
    rope_beta_fast: float = 32.0
    """YaRN ramp bound (``rope_parameters.beta_fast``)."""
    rope_beta_slow: float = 1.0
    """YaRN ramp bound (``rope_parameters.beta_slow``)."""
    rope_truncate: bool = False
    """Round YaRN's correction range to whole dimensions (``rope_parameters.truncate``; GPT-OSS: false)."""

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim

    def is_sliding(self, i: int) -> bool:
        return self.layer_types[i] == lt.SLIDING


limits(GptOssConfig, head_dim=gt(0), num_experts=gt(0), top_k=gt(0), expert_intermediate_size=gt(0),
       swiglu_alpha=gt(0), swiglu_limit=gt(0), sliding_window=ge(0), layer_types=lt.RULE,
       rope_scaling=one_of("default", "yarn"), rope_factor=ge(1), rope_original_max_position_embeddings=gt(0),
       rope_beta_fast=gt(0), rope_beta_slow=gt(0))
