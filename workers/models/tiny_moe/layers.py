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
from torch.nn.attention import SDPBackend, sdpa_kernel

#: GPU fast paths (grouped-GEMM experts, causal flash attention through SDPA) run on CUDA
#: tensors only, so CPU numerics stay exactly the reference loop's. Tests set this to True
#: to exercise the fast path on CPU against the reference.
FAST_PATH_ON_CPU = False


#: SDPA backends for masked attention on CUDA (decode with a KV cache, left padding). Not
#: cuDNN: it builds a graph per key length, i.e. on every decode step (~100 ms/step seen on H200).
MASKED_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
#: SDPA backends for the causal fast path (training, scoring); None leaves torch's choice (cuDNN on H100/H200).
CAUSAL_SDPA_BACKENDS: Optional[list] = None


def fast(x: torch.Tensor) -> bool:
    return x.is_cuda or FAST_PATH_ON_CPU


class KVCache:
    """Per-layer key/value tensors ``[B, H, T, D]`` plus the key validity mask ``[B, T]``."""

    def __init__(self, num_layers: int):
        self.keys: list[Optional[torch.Tensor]] = [None] * num_layers
        self.values: list[Optional[torch.Tensor]] = [None] * num_layers
        self.key_mask: Optional[torch.Tensor] = None

    @property
    def length(self) -> int:
        return 0 if self.key_mask is None else self.key_mask.shape[1]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows in ``rows`` (finished sequences leave the batch)."""
        self.keys = [k.index_select(0, rows) if k is not None else None for k in self.keys]
        self.values = [v.index_select(0, rows) if v is not None else None for v in self.values]
        if self.key_mask is not None:
            self.key_mask = self.key_mask.index_select(0, rows)


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
        if attn_mask is None:  # fast path: no pads before any valid key, no cache (flash attention)
            if CAUSAL_SDPA_BACKENDS is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                with sdpa_kernel(CAUSAL_SDPA_BACKENDS):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif q.is_cuda:
            with sdpa_kernel(MASKED_SDPA_BACKENDS):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Expert(nn.Module):
    def __init__(self, h: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def dense_mask(key_mask: torch.Tensor, t: int, past: int) -> torch.Tensor:
    """[B, t, past+t] bool: causal over cache + new tokens, valid keys only, always self."""
    dev = key_mask.device
    causal = torch.ones(t, past + t, dtype=torch.bool, device=dev).tril(diagonal=past)
    mask = causal[None] & key_mask[:, None, :]
    return mask | torch.eye(t, past + t, dtype=torch.bool, device=dev).roll(past, dims=1)[None]


def right_padded(valid: torch.Tensor) -> bool:
    """True when every row is valid tokens then pads (or no pads): plain causal attention then
    gives every valid query exactly its masked result (pad queries differ, and are ignored)."""
    return valid.shape[1] < 2 or bool((valid[:, :-1] | ~valid[:, 1:]).all())
