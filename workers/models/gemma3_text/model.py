"""Gemma 3's text decoder in plain torch from the shared blocks: the module the trainer and the embedded engine run.

Per layer (workers/models/blocks/sandwich_layer.py, norms blocks/norm.py GemmaRMSNorm ``x * (1 + w)``):
GQA attention (blocks/attention.py) with Gemma q/k norms before rotary, softmax scale
``query_pre_attn_scalar ** -0.5``, and per ``layer_types`` either a sliding window of
``sliding_window`` keys with rotary base ``rope_local_base_freq`` or full attention with ``rope_theta``
(linearly scaled by ``rope_linear_factor``); then the GELU-tanh gated MLP (blocks/mlp.py). The
embedding output is multiplied by sqrt(hidden_size) rounded to the compute dtype (transformers'
Gemma3TextScaledWordEmbedding: 55.5, not 55.43, in bf16 for hidden 3072); the head is the
unscaled embedding matrix when tied. Parameter names are the checkpoint's
(``model.layers.N.pre_feedforward_layernorm.weight``, ``model.layers.N.self_attn.q_norm.weight``),
so a checkpoint loads with ``load_state_dict(strict=True)`` and ``state_dict()`` is one transformers loads.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from workers.models.blocks.attention import Attention
from workers.models.blocks.decoder import Backbone, CausalLM
from workers.models.blocks.mlp import GeluTanhGLU
from workers.models.blocks.norm import GemmaRMSNorm
from workers.models.blocks.rope_scaled import Rope
from workers.models.blocks.sandwich_layer import SandwichDecoderLayer
from workers.models.gemma3_text.config import Gemma3TextConfig


class ScaledEmbedding(nn.Embedding):
    """``embedding(ids) * scale``, the scale rounded to the weight's dtype first (as transformers does)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float):
        super().__init__(num_embeddings, embedding_dim)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = super().forward(ids)
        # a fill on the device, not torch.tensor (a host-to-device copy that CUDA-graph capture refuses)
        return x * torch.full((), self.scale, dtype=torch.float32, device=x.device).to(x.dtype)


def rope_of(cfg: Gemma3TextConfig, sliding: bool) -> Rope:
    """The rotary embedding of a sliding (local base) or full (global base, maybe linear) layer."""
    if sliding:
        return Rope(dim=cfg.head_dim, theta=cfg.rope_local_base_freq)
    if cfg.rope_linear_factor != 1:
        return Rope(dim=cfg.head_dim, theta=cfg.rope_theta, scaling="linear", factor=cfg.rope_linear_factor)
    return Rope(dim=cfg.head_dim, theta=cfg.rope_theta)


def gemma3_layer(cfg: Gemma3TextConfig, i: int) -> SandwichDecoderLayer:
    h, hd, eps = cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps
    sliding = cfg.is_sliding(i)
    attn = Attention(hidden_size=h, num_heads=cfg.num_heads, num_kv_heads=cfg.kv_heads, head_dim=hd,
                     rope_theta=cfg.rope_local_base_freq if sliding else cfg.rope_theta, rope=rope_of(cfg, sliding),
                     sliding_window=cfg.sliding_window if sliding else None, scaling=cfg.query_pre_attn_scalar ** -0.5)
    attn.q_norm, attn.k_norm = GemmaRMSNorm(hd, eps), GemmaRMSNorm(hd, eps)  # (1 + w), not the Qwen3 norm
    return SandwichDecoderLayer(attention=attn, mlp=GeluTanhGLU(h, cfg.dense_intermediate_size),
                                norm=functools.partial(GemmaRMSNorm, h, eps))


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, cfg: Gemma3TextConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(ScaledEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.hidden_size ** 0.5),
                              [gemma3_layer(cfg, i) for i in range(cfg.num_layers)],
                              GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps))
        self.make_head()

    def init_tensor(self, name: str, shape: tuple, gen: torch.Generator) -> torch.Tensor:
        """The default rule, except norms: a Gemma norm weight is an offset from 1, so 0 is the identity."""
        if name.endswith("norm.weight"):
            return torch.zeros(shape)
        return super().init_tensor(name, shape, gen)


def build(cfg: Gemma3TextConfig, *, device=None, dtype=None) -> Gemma3ForCausalLM:
    return Gemma3ForCausalLM.create(cfg, device=device, dtype=dtype)


def init(cfg: Gemma3TextConfig, dtype=torch.float32) -> Gemma3ForCausalLM:
    return Gemma3ForCausalLM.step0(cfg, dtype)
