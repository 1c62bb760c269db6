"""Grouped-query attention with rotary embedding and the inference KV cache (Llama, Qwen3, Qwen2, Mistral, tiny_moe).

One block for the softmax-attention families whose checkpoints hold q/k/v/o projections:

- GQA: ``num_kv_heads`` key/value heads, each read by ``num_heads / num_kv_heads`` query heads
  (query head ``j*g+i`` reads kv head ``j``, HF's ``repeat_kv`` layout); the cache keeps the kv
  heads only, which is GQA's memory saving.
- ``head_dim`` is free: Qwen3 has 128-wide heads on a 2048 residual with 32 heads (q_proj is
  then ``[num_heads*head_dim, hidden]``, not square); Llama and tiny_moe use hidden/heads.
- ``qk_norm_eps``: Qwen3's per-head RMSNorm of queries and keys (``q_norm`` / ``k_norm``, a
  ``[head_dim]`` weight shared by all heads), applied BEFORE the rotary embedding. Per head, so a
  tensor-parallel rank holding whole heads applies it unchanged (its gradient is partial per
  rank: workers/trainer/parallel/tensor.py sums it over the group).
- Rotary: the NeoX half-split convention of HF Llama/Qwen ("rotate_half"), cos/sin computed once
  per forward and shared by every layer with the same (head_dim, theta) through ``ctx.shared``.
  ``rope`` (a workers/models/blocks/rope_scaled.py ``Rope``): a scaled rotary embedding instead
  (GPT-OSS's YaRN, Gemma 3's linear global layers), shared by the layers with an equal one.
- ``qkv_bias`` / ``o_bias``: biases on the q/k/v projections (Qwen2) and on o_proj (GPT-OSS, Qwen3's
  ``attention_bias``). Under tensor parallel the q/k/v biases split with their heads and o_proj's is
  replicated, added once after the row-parallel sum (DTensor's Colwise/RowwiseParallel do both).
- ``sliding_window``: each query sees its last ``sliding_window`` keys (itself included; transformers'
  rule, workers/models/blocks/masking.py) in every path: the banded mask of the dense, cached and
  static-slot paths (``ctx.window_mask``), the plain causal and packed-document kernels, Ulysses.
- ``scaling``: the softmax scale, None for 1/sqrt(head_dim) (Gemma 3: query_pre_attn_scalar**-0.5).
- ``sinks``: one learned sink logit per query head, ``self_attn.sinks [num_heads]`` (GPT-OSS): an
  extra softmax term whose probability is dropped (masking.with_sinks), in every path. Under tensor
  parallel it is sharded with the heads (workers/trainer/parallel/mesh.py): a DTensor read locally here.

``forward(x, ctx)`` reads ``ctx.position_ids``, ``ctx.mask`` (None: plain causal), ``ctx.cache``
and ``ctx.layer``; the cache gets this layer's keys/values appended along time (dim -2).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from workers.models.blocks import kernels, ulysses
from workers.models.blocks.norm import RMSNorm


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin ``[B, 1, T, head_dim]`` for positions ``[B, T]`` (angles in float32, then cast)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.float()[..., None] * inv  # [B, T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: ``rotate_half(x) * sin == swap_halves(x) * signed_sin(sin)``
    exactly (a negation is exact), one kernel fewer per rotation (:func:`apply_rope_qk`)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def apply_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rope` of q and k, bit for bit, in 5 kernels instead of 10: both rotated as one
    tensor, the negation folded into ``sin_signed`` (computed once per forward). The static engine's
    decode step is a few hundred tiny kernels per CUDA-graph replay; each costs its launch slot."""
    nh, half = q.shape[1], q.shape[-1] // 2
    qk = torch.cat([q, k], dim=1)
    out = qk * cos + torch.cat([qk[..., half:], qk[..., :half]], dim=-1) * sin_signed
    return out[:, :nh], out[:, nh:]


class Attention(nn.Module):
    """q/k/v/o projections over ``num_heads`` query and ``num_kv_heads`` kv heads of ``head_dim``
    (the keyword options: module docstring)."""

    kv_slots = True  # the static engine's cache keeps nkv x hd keys/values per position (static_cache.py)

    def __init__(self, *, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, rope_theta: float,
                 qk_norm_eps: Optional[float] = None, qkv_bias: bool = False, o_bias: bool = False,
                 sliding_window: Optional[int] = None, scaling: Optional[float] = None, sinks: bool = False,
                 rope=None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"attention: num_kv_heads({num_kv_heads}) must divide num_heads({num_heads})")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"attention: sliding_window({sliding_window}) must be >= 1 (None: no window)")
        self.nh, self.nkv, self.hd, self.rope_theta = num_heads, num_kv_heads, head_dim, rope_theta
        self.sliding_window, self.scaling, self.rope = sliding_window, scaling, rope
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None

    def local_sinks(self) -> Optional[torch.Tensor]:
        """The sink logits of this rank's heads (a tensor-parallel DTensor read as its local shard)."""
        s = self.sinks
        return s.to_local() if isinstance(s, DTensor) else s

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.hd)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        if self.q_norm is not None:  # per head, before rotary (Qwen3)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if self.rope is not None:
            rope_key = ("rope", self.rope)
            cos, sin = ctx.shared(rope_key, lambda: self.rope.cos_sin(ctx.position_ids, x.dtype))
        else:
            rope_key = ("rope", self.hd, self.rope_theta)
            cos, sin = ctx.shared(rope_key, lambda: rope_cos_sin(ctx.position_ids, self.hd, self.rope_theta, x.dtype))
        cache, layer = ctx.cache, ctx.layer
        window, scale, sinks = self.sliding_window, self.scaling, self.local_sinks()
        mask = ctx.window_mask(window)
        if cache is not None and cache.static:  # preallocated slots: it writes k/v and attends (grouped heads)
            q, k = apply_rope_qk(q, k, cos, ctx.shared(rope_key + ("signed_sin",), lambda: signed_sin(sin)))
            out = cache.attend(layer, q, k, v, mask, scale=scale, sinks=sinks)
            return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # the cache holds the kv heads only (GQA's memory saving)
            if cache.keys[layer] is not None:
                k = torch.cat([cache.keys[layer], k], dim=2)
                v = torch.cat([cache.values[layer], v], dim=2)
            cache.keys[layer], cache.values[layer] = k, v
        if ctx.cp is not None:  # context parallel: this rank's heads over the whole sequence
            out = ulysses.attend(q, k, v, mask, ctx.cp, scale, docs=ctx.docs, window=window, sinks=sinks)
            return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        if self.nkv != self.nh:  # query head j*g+i reads kv head j (HF's repeat_kv)
            k = k.repeat_interleave(self.nh // self.nkv, dim=1)
            v = v.repeat_interleave(self.nh // self.nkv, dim=1)
        # mask None: plain causal (flash attention, or the banded varlen kernel under a window)
        out = kernels.attend(q, k, v, mask, scale, docs=ctx.docs, window=window, sinks=sinks)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
