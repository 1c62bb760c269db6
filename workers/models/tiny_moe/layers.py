"""Building blocks of the tiny_moe / llama decoder: attention with rotary embedding and a KV cache,
RMSNorm, the SwiGLU MLP, attention masks, and the GPU fast-path switches.

Split from model.py (the model and its forward) and moe.py (the routed experts) to keep each
file readable; parameter names are HF Llama's (``self_attn.q_proj``, ``mlp.gate_proj`` ...).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.blocks import kernels
from workers.models.blocks.cache import KVCache  # noqa: F401  (re-exported)
from workers.models.blocks.decoder import dense_mask, right_padded  # noqa: F401  (re-exported)

def fast(x: torch.Tensor) -> bool:
    """The GPU fast-path switch (workers/models/blocks/kernels.py; tests flip kernels.FAST_PATH_ON_CPU)."""
    return kernels.fast(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the compute dtype, as HF models do.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.float()[..., None] * inv  # [B, T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [B, 1, T, D]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, self.nh, self.hd, self.nkv = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.kv_heads
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(self, x, cos, sin, attn_mask, cache: Optional[KVCache], layer: int):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # the cache holds the kv heads only (GQA's memory saving)
            if cache.keys[layer] is not None:
                k = torch.cat([cache.keys[layer], k], dim=2)
                v = torch.cat([cache.values[layer], v], dim=2)
            cache.keys[layer], cache.values[layer] = k, v
        if self.nkv != self.nh:  # query head j*g+i reads kv head j (HF Llama's repeat_kv)
            k = k.repeat_interleave(self.nh // self.nkv, dim=1)
            v = v.repeat_interleave(self.nh // self.nkv, dim=1)
        out = kernels.attend(q, k, v, attn_mask)  # attn_mask None: plain causal (flash attention)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Expert(nn.Module):
    def __init__(self, h: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
