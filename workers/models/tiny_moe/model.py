"""tiny_moe: a small causal Mixture-of-Experts decoder in plain torch (and, with no experts, the
dense Llama of model.family=llama).

Shared by the embedded inference engine and the trainer (through the family specs
workers/models/tiny_moe/spec.py and workers/models/llama/spec.py), so both compute the very
same function (the train/inference mismatch then comes only from dtype and kernel
order, which is what Router Replay and the mismatch metrics are about).

Parameter names follow the Hugging Face Qwen3-MoE layout (``model.layers.N.mlp.
experts.E.gate_proj.weight`` ...) so checkpoints are ordinary HF-style safetensors.

Two entry points:
- ``forward(input_ids, ...)``: full-sequence forward (training, scoring, prefill).
- ``forward(..., cache=KVCache)``: incremental decode; the cache grows by the new tokens.
Every forward returns the experts each token was routed to (``routed_experts``,
int64 ``[B, T, num_layers, top_k]``) and accepts ``forced_experts`` of that shape to
replay a routing decision while still computing gate weights from this model's own
router scores (so router gradients flow): the spec's ``router_hook``.

The config is the family's schema itself (workers/models/tiny_moe/config.py TinyMoeConfig, or
workers/models/llama/config.py LlamaConfig); blocks live in layers.py and moe.py.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from workers.common.dtypes import torch_dtype
from workers.models.blocks.decoder import Backbone, CausalLM, ForwardContext, ModelOutput, Routing  # noqa: F401
from workers.models.tiny_moe.config import DecoderConfig, TinyMoeConfig  # noqa: F401  (re-exported)
from workers.models.tiny_moe.layers import (Attention, Expert, KVCache, RMSNorm, apply_rope,  # noqa: F401
                                            dense_mask, right_padded, rope_cos_sin)
from workers.models.tiny_moe.moe import MoeBlock


class DecoderLayer(nn.Module):
    """Pre-norm attention + (MoE or dense SwiGLU) MLP: ``forward(x, ctx) -> (x, Routing | None)``."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.config = cfg
        self.routed = not cfg.is_dense
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # A dense layer's MLP is one SwiGLU block named like HF Llama's (mlp.gate_proj ...).
        self.mlp = Expert(cfg.hidden_size, cfg.dense_intermediate_size) if cfg.is_dense else MoeBlock(cfg)

    def forward(self, x: torch.Tensor, ctx: ForwardContext):
        c = self.config
        cos, sin = ctx.shared("rope", lambda: rope_cos_sin(ctx.position_ids, c.head_dim, c.rope_theta, x.dtype))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx.mask, ctx.cache, ctx.layer)
        if not self.routed:
            return x + self.mlp(self.post_attention_layernorm(x)), None
        y, idx, aux, load = self.mlp(self.post_attention_layernorm(x), ctx.forced, ctx.valid, ctx.forced_mask)
        return x + y, Routing(experts=idx, aux_loss=aux, load=load)


class TinyMoeForCausalLM(CausalLM):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(nn.Embedding(cfg.vocab_size, cfg.hidden_size),
                              [DecoderLayer(cfg) for _ in range(cfg.num_layers)], RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))
        self.make_head()

    @torch.no_grad()
    def init_weights(self, seed: int) -> "TinyMoeForCausalLM":
        """Deterministic init from ``seed`` (independent of the global RNG state)."""
        gen = torch.Generator().manual_seed(seed)
        std = self.config.init_std
        for name, p in sorted(self.named_parameters()):
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                scale = std / math.sqrt(2 * self.config.num_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
        return self


def build_model(cfg: DecoderConfig, seed: int, dtype: torch.dtype = torch.float32) -> TinyMoeForCausalLM:
    return TinyMoeForCausalLM(cfg).init_weights(seed).to(dtype)


def num_parameters(cfg: DecoderConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in TinyMoeForCausalLM(cfg).parameters())


def build(cfg: DecoderConfig, *, device=None, dtype=None) -> TinyMoeForCausalLM:
    """The module with uninitialised weights on ``device`` (``"meta"``: nothing allocated) in ``dtype``
    (a torch dtype or its name). Off meta it is made on the CPU first, then moved, as it always was."""
    if isinstance(dtype, str):
        dtype = torch_dtype(dtype)
    if str(device) == "meta":
        with torch.device("meta"):
            return TinyMoeForCausalLM(cfg).to(dtype=dtype)
    return TinyMoeForCausalLM(cfg).to(device=device, dtype=dtype)


def init(cfg: DecoderConfig, dtype=torch.float32) -> TinyMoeForCausalLM:
    """Step-0 weights on the CPU: a Hugging Face checkpoint directory (``cfg.path``: built on meta,
    streamed in tensor by tensor), the converted ``cfg.pretrained`` checkpoint, or seeded from
    ``cfg.init_seed`` (std ``cfg.init_std``). HF names are this model's: the spec's from_hf is the identity."""
    if isinstance(dtype, str):
        dtype = torch_dtype(dtype)
    if cfg.path:
        from workers.common.registry import MODELS
        from workers.models.hf_checkpoint import load_pretrained

        return load_pretrained(build(cfg, device="meta", dtype=dtype), cfg, MODELS.get(cfg.family).from_hf)
    if not cfg.pretrained:
        return build_model(cfg, cfg.init_seed, dtype)
    from workers.models.pretrained import load_state_dict, require_prepared  # safetensors only

    model = TinyMoeForCausalLM(cfg)
    model.load_state_dict(load_state_dict(require_prepared(cfg)), strict=True)
    return model.to(dtype)
