"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2, GLM-5), with its latent KV cache.

Queries: ``q_proj`` (``q_lora_rank`` 0) or the low-rank pair ``q_a_proj -> q_a_layernorm ->
q_b_proj``; each head is ``qk_nope_head_dim`` channels without position plus ``qk_rope_head_dim``
rotated ones. Keys and values come from one compressed latent per token: ``kv_a_proj_with_mqa``
gives the ``kv_lora_rank`` latent (normed by ``kv_a_layernorm``) and one rotated key slice shared
by all heads; ``kv_b_proj`` expands the latent into every head's unrotated key and its value
(``v_head_dim``). Parameter names are the checkpoints'.

KV cache layout: ``cache.keys[layer]`` is ``[B, T, kv_lora_rank + qk_rope_head_dim]``, the
normed latent followed by the rotated shared key, i.e. exactly what MLA must remember (576 values
a token for DeepSeek-V3/Kimi-K2, as the plan's KV bytes count); ``cache.values[layer]`` stays
None. Each step re-expands the cached latents through ``kv_b_proj`` (the reference path; folding
``kv_b_proj`` into the query and output, "weight absorption", is a later optimisation).

An optional ``indexer`` (DeepSeek Sparse Attention, workers/models/blocks/dsa_indexer.py)
narrows each query's keys to its top ``index_topk``. With ``dsa_chunk`` > 0 (GLM-5's default) the
attention gathers each query's chosen keys a chunk of queries at a time (workers/models/blocks/
dsa_sparse.py: memory linear in the sequence); with 0 the indexer's keep mask is ANDed into the
attention mask (the dense reference path of sparse attention). Packed rows (``ctx.docs``) attend
per document (workers/models/blocks/varlen.py), the indexer choosing inside each document.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from workers.models.blocks import dsa_sparse, kernels, ulysses
from workers.models.blocks.decoder import ForwardContext
from workers.models.blocks.dsa_fused import fused_applies
from workers.models.blocks.dsa_indexer import shared_mask
from workers.models.blocks.rope_scaled import rotate
from workers.models.blocks.norm import RMSNorm
from workers.models.blocks.varlen import attend_docs

LORA_NORM_EPS = 1e-6
"""Epsilon of q_a_layernorm / kv_a_layernorm: the checkpoints' code fixes it (not rms_norm_eps)."""


class MLAttention(nn.Module):
    def __init__(self, *, hidden_size: int, num_heads: int, q_lora_rank: int, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, softmax_scale: float,
                 interleaved: bool):
        super().__init__()
        self.nh, self.r = num_heads, kv_lora_rank
        self.dn, self.dr, self.dv = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.q_lora_rank, self.scale, self.interleaved = q_lora_rank, softmax_scale, interleaved
        qk = num_heads * (qk_nope_head_dim + qk_rope_head_dim)
        if q_lora_rank:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(q_lora_rank, qk, bias=False)
        else:
            self.q_proj = nn.Linear(hidden_size, qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=False)
        self.indexer: Optional[nn.Module] = None  # set by families with sparse attention (GLM-5)
        self.reuses_index = False  # a DSA "shared" layer: the previous full layer's choice of keys
        self.dsa_chunk = 0  # > 0: sparse attention over the chosen keys, this many queries at a time (dsa_sparse.py)
        self.dsa_kernel = "auto"  # auto: the fused Triton kernel where it applies (dsa_fused.py); torch: gathers

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x ``[B, T, H]`` (normed), cos/sin ``[B, 1, T, qk_rope_head_dim]``; uses ctx.mask and ctx.cache."""
        b, t, _ = x.shape
        q_latent = None
        if self.q_lora_rank:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_latent)
        else:
            q = self.q_proj(x)
        q_nope, q_rot = q.view(b, t, self.nh, self.dn + self.dr).transpose(1, 2).split([self.dn, self.dr], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.r, self.dr], dim=-1)
        shared = self.__dict__.get("tp_shared")  # tensor parallel: heads on other ranks use k_rot too
        if shared is not None:
            k_rot = shared(k_rot)
        q_rot = rotate(q_rot, cos, sin, self.interleaved)
        k_rot = rotate(k_rot[:, None], cos, sin, self.interleaved)[:, 0]
        normed = self.kv_a_layernorm(latent)
        static = ctx.cache is not None and ctx.cache.static  # fixed slots (the static engine): the dense path
        chunked = self.dsa_chunk > 0 and (self.indexer is not None or self.reuses_index) and not static
        if shared is not None and chunked:  # read by every head through the absorbed kv_b_proj: gradient over tp
            normed = shared(normed)
        entry = torch.cat([normed, k_rot], dim=-1)  # [B, T, r + dr]: what is cached
        if ctx.cache is not None and ctx.cache.static:  # preallocated slots: all L positions, masked
            entry = ctx.cache.write_latent(ctx.layer, entry)
        elif ctx.cache is not None:
            past = ctx.cache.keys[ctx.layer]
            if past is not None:
                entry = torch.cat([past, entry], dim=1)
            ctx.cache.keys[ctx.layer] = entry
        if chunked:
            out = self._sparse(x, q_latent, q_nope, q_rot, entry, cos, sin, ctx)
            return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.dv))
        latent_all, k_rot_all = entry.split([self.r, self.dr], dim=-1)
        s = entry.shape[1]
        kv = self.kv_b_proj(latent_all).view(b, s, self.nh, self.dn + self.dv).transpose(1, 2)
        k_nope, v = kv.split([self.dn, self.dv], dim=-1)
        k = torch.cat([k_nope, k_rot_all[:, None].expand(b, self.nh, s, self.dr)], dim=-1)
        q = torch.cat([q_nope, q_rot], dim=-1)
        mask, sparse = ctx.mask, self.indexer is not None or self.reuses_index
        per_doc = ctx.docs is not None and ctx.cp is None
        if self.indexer is not None:
            restrict = self.indexer.restrict_docs if per_doc else self.indexer.restrict
            mask = restrict(x, q_latent, cos, sin, ctx)
        elif self.reuses_index:
            mask = shared_mask(ctx)
        if ctx.cp is not None:  # context parallel: this rank's heads over the whole sequence (after kv_b_proj)
            out = ulysses.attend(q, k, v, mask, ctx.cp, self.scale, docs=None if sparse else ctx.docs)
        elif per_doc:  # packed rows: per document; sparse layers pass per-document keep masks
            out = attend_docs(q, k, v, ctx.docs, self.scale, mask if sparse else None)
        else:
            out = kernels.attend(q, k, v, mask, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.dv))

    def _sparse(self, x: torch.Tensor, q_latent: torch.Tensor, q_nope: torch.Tensor, q_rot: torch.Tensor,
                entry: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """DSA's memory-linear path (workers/models/blocks/dsa_sparse.py): ``[B, H, T, dv]``. Under cp
        each rank gathers every latent key (``T x (r + dr)``) and attends with its own queries."""
        chosen = (self.indexer.choose(x, q_latent, cos, sin, ctx, self.dsa_chunk) if self.indexer is not None
                  else shared_mask(ctx))
        w = self.kv_b_proj.weight
        w = (w.to_local() if hasattr(w, "to_local") else w).view(self.nh, self.dn + self.dv, self.r)  # tp: own heads
        fused = self.dsa_kernel == "auto" and fused_applies(q_nope)
        if isinstance(chosen, dict):
            return dsa_sparse.attend_latent_docs(q_nope, q_rot, entry, w, ctx.docs, chosen, self.scale, self.dsa_chunk,
                                                 fused)
        if ctx.cp is not None:
            entry = ulysses.gather_seq_grad(entry, ctx.cp)
        return dsa_sparse.attend_latent(q_nope, q_rot, entry, w, chosen, self.scale, self.dsa_chunk, fused)
