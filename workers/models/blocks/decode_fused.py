"""The dense pre-norm layer's decode step over the static cache, in fused kernels (issue 45).

Why: the static engine's decode step is one CUDA-graph replay of a few hundred tiny kernels whose
count is its cost (workers/models/blocks/decode_kernels.py). For a layer of the dense families
(Llama / SmolLM2, Qwen2, Mistral: RMSNorm, GQA with the plain rotary embedding, SwiGLU) this
path runs, per layer: norm (1), q/k/v (3 GEMMs), rotary + KV-cache write (1), attention (1),
the heads' flatten (1), o_proj (1), residual add + norm (1), gate and up (2), SwiGLU's activation
(1), down (1), residual add (1): 14 kernels where the general path launches 38.

Qwen3's per-head q/k norms are one norm kernel each on the same path. A routed layer (Qwen3-MoE,
tiny_moe) takes the same norm / attention / add + norm kernels around its MoE block, which runs as
it is (:func:`attention_step`; the layer returns the block's routing): at Qwen3-30B-A3B's widths
that removes ~50 of a decode layer's ~100 small kernels, common to bf16 and fp8 engines alike.

Only for a one-token-per-row step of the static cache (``cache.static and cache.decoding``); the
trainer, the prefill and the dynamic engine keep the general path. The projections are called as
modules, so LoRA's hooks and fp8's linears (workers/inference/embedded/) apply unchanged and
weight updates (in place) reach this path with nothing to refresh. Layers it does not cover
(sinks, a scaled rotary, Gemma's norms and GELU) keep the general path, wholly or for their
attention: :func:`covers` and :func:`attention_covered` decide once per layer.
"""
from __future__ import annotations

import torch
from torch import nn

from workers.models.blocks.attention import Attention, rope_cos_sin, signed_sin
from workers.models.blocks.decode_kernels import add_rms_norm, rms_norm, rope_write_kv, silu_mul
from workers.models.blocks.mlp import SwiGLU
from workers.models.blocks.norm import RMSNorm


def decoding(ctx) -> bool:
    """A one-token-per-row step of the static engine (where the fused path applies)."""
    cache = ctx.cache
    return cache is not None and cache.static and cache.decoding


def attention_covered(attn: nn.Module) -> bool:
    """GQA with the plain rotary embedding, no sinks, plain RMSNorm q/k norms if any (Qwen3), and a
    power-of-two head width (the rotary kernel holds one head in a block)."""
    norms_ok = attn.q_norm is None or (type(attn.q_norm) is RMSNorm and type(attn.k_norm) is RMSNorm)
    return (type(attn) is Attention and norms_ok and attn.sinks is None and attn.rope is None
            and attn.hd & (attn.hd - 1) == 0)


def covers(layer: nn.Module) -> bool:
    """The layer is RMSNorm + (any attention) + RMSNorm + a SwiGLU MLP or a routed MoE block (host
    checks: under CUDA graphs they run at capture only)."""
    return (type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm
            and (layer.routed or type(layer.mlp) is SwiGLU))


def attention_step(layer: nn.Module, x: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """``x + attn(norm(x))`` and its post-attention norm, for one token per row: ``(x, h)``."""
    h = rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.eps)
    attn = layer.self_attn
    a = attend(attn, h, ctx) if attention_covered(attn) else attn(h, ctx)
    norm = layer.post_attention_layernorm
    return add_rms_norm(x, a, norm.weight, norm.eps)


def layer_step(layer: nn.Module, x: torch.Tensor, ctx) -> torch.Tensor:
    """``x + attn(norm(x))`` then ``+ mlp(norm(.))`` for one token per row of a dense layer, in fused kernels."""
    x, h = attention_step(layer, x, ctx)
    mlp = layer.mlp
    return x + mlp.down_proj(silu_mul(mlp.gate_proj(h), mlp.up_proj(h)))


def attend(attn: Attention, h: torch.Tensor, ctx) -> torch.Tensor:
    """GQA over the static slots for one token per row: q/k/v, then rotary + cache write in one kernel."""
    b = h.shape[0]
    q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
    if attn.q_norm is not None:  # Qwen3: per head, before rotary
        q = rms_norm(q.reshape(b, attn.nh, attn.hd), attn.q_norm.weight, attn.q_norm.eps)
        k = rms_norm(k.reshape(b, attn.nkv, attn.hd), attn.k_norm.weight, attn.k_norm.eps)
    key = ("rope", attn.hd, attn.rope_theta)
    cos, sin = ctx.shared(key, lambda: rope_cos_sin(ctx.position_ids, attn.hd, attn.rope_theta, h.dtype))
    cos, sin_signed = ctx.shared(key + ("decode",), lambda: (cos.reshape(b, -1).contiguous(),
                                                             signed_sin(sin).reshape(b, -1).contiguous()))
    cache, layer = ctx.cache, ctx.layer
    q = rope_write_kv(q.view(b, -1), k.view(b, -1), v.view(b, -1), cos, sin_signed,
                      cache.keys[layer], cache.values[layer], cache.slots, cache.positions().view(b))
    g = attn.nh // attn.nkv
    out = cache.attend_written(layer, q.view(b, attn.nkv, g, attn.hd), ctx.window_mask(attn.sliding_window),
                               attn.scaling)
    return attn.o_proj(out.reshape(b, 1, -1))


def final_norm(norm: nn.Module, x: torch.Tensor, ctx) -> torch.Tensor:
    """The backbone's last norm, one kernel in a decode step of the static cache."""
    if decoding(ctx) and type(norm) is RMSNorm:
        return rms_norm(x, norm.weight, norm.eps)
    return norm(x)
