"""Sparse attention over the DSA indexer's choice, in query chunks: memory linear in the sequence.

Why: the dense reference path of DeepSeek Sparse Attention (workers/models/blocks/dsa_indexer.py
``restrict``) scores every (query, key) pair and ANDs a [T, S] keep mask into dense attention:
~2.3 TB at 131,072 tokens for GLM-5. This path never builds a [T, S] tensor:

* the indexer scores one chunk of ``chunk`` queries against every key it may see at a time and
  keeps only each query's top-k key positions, ``chosen`` int32 ``[B, T, K]`` (``K = min(topk,
  S)``), -1 where a query may see fewer than K keys (the dense path drops those too);
* attention (:func:`attend_latent`) gathers, for one chunk of queries, the chosen keys' cached
  MLA latents ``[B, C, K, kv_lora_rank + qk_rope_head_dim]`` and takes the softmax over those K
  only, with ``kv_b_proj`` absorbed into the query and the output (never expanded per head):
  O(chunk x K x (latent + heads)) at a time. On CUDA (``model.dsa_attention_kernel=auto``) the
  Triton kernel of workers/models/blocks/dsa_fused.py does the same without the gathers (its
  chunks then hold thousands of queries: nothing per key is materialised).

Exactness: the indexer's rows are the dense path's rows (same scores, same top-k per row), and a
softmax over the K chosen keys equals a softmax over all keys with the others masked out; only
the order of the float sums differs (absorption re-associates the products; fp32: ~1e-7 relative).

Gradients: the choice is not differentiable (the indexer runs under no_grad in both paths: the LM
loss trains it not at all, as in transformers). The attention of each chunk runs under
non-reentrant activation checkpointing, so the backward keeps only its inputs (views of the queries, the
latents, kv_b_proj's weight and the chunk's indices) and recomputes the gathered latents one chunk at a time; the gathers'
backward scatters into the ``[B, S, r + dr]`` latent gradient (linear).

Where it runs (``MLAttention.dsa_chunk`` > 0, GLM-5's ``model.dsa_chunk_tokens``): plain and
left-padded rows (the chosen rows read ``ctx.mask`` a chunk at a time), packed rows (per
document, :func:`attend_latent_docs`), context parallelism (each rank all-gathers the latents,
``T x (r + dr)``, and attends with its own queries, all heads: no head all-to-all), tensor
parallelism (``w_kv`` is the rank's heads of kv_b_proj) and the embedded engine's prefill and
decode (the cache's latents are the key axis).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

from workers.models.blocks.dsa_fused import latent_reference, sparse_latent_attention
from workers.models.blocks.varlen import Documents

RowsFn = Callable[[int, int], torch.Tensor]
"""``rows(a, b)`` -> bool ``[B, b - a, S]``: which keys queries ``a .. b-1`` may see before sparsity."""


def topk_rows(score: Callable[[int, int], torch.Tensor], rows: RowsFn, t: int, s: int, topk: int,
              chunk: int) -> torch.Tensor:
    """int32 ``[B, t, min(topk, s)]``: each query's best keys by ``score(a, b)`` (float ``[B, b-a, s]``)
    among ``rows(a, b)``, -1 where fewer are visible. One chunk of scores alive at a time."""
    k = min(topk, s)
    parts = []
    for a in range(0, t, chunk):
        b = min(a + chunk, t)
        index = score(a, b).masked_fill(~rows(a, b), float("-inf"))
        vals, idx = index.topk(k, dim=-1)
        parts.append(torch.where(vals > float("-inf"), idx, -1).to(torch.int32))
    return torch.cat(parts, dim=1)


def visible_rows(mask: Optional[torch.Tensor], docs: Optional[Documents], b: int, s: int, past: int, offset: int,
                 device) -> RowsFn:
    """The rows of what each query may see, ``offset`` added to the query index (a cp rank's first
    global row): ``mask [B, 1, T, S]`` when the forward has one, else per document, else causal
    (query i sees keys ``<= past + i``)."""
    if mask is not None:
        return lambda lo, hi: mask[:, 0, offset + lo:offset + hi]
    if docs is not None:
        return lambda lo, hi: docs.causal_rows(offset + lo, hi - lo)
    keys = torch.arange(s, device=device)

    def causal(lo: int, hi: int) -> torch.Tensor:
        q = torch.arange(past + offset + lo, past + offset + hi, device=device)
        return (keys[None, :] <= q[:, None])[None].expand(b, hi - lo, s)

    return causal


def _chunk(q_nope: torch.Tensor, q_rot: torch.Tensor, entry: torch.Tensor, w_kv: torch.Tensor, chosen: torch.Tensor,
           scale: float, fused: bool = False) -> torch.Tensor:
    """One chunk of queries over their chosen latent keys: ``q_nope [B, H, C, dn]``, ``q_rot [B, H, C, dr]``,
    ``entry [B, S, r + dr]`` (normed latent, rotated shared key), ``w_kv [H, dn + dv, r]`` (kv_b_proj
    per head), ``chosen [B, C, K]`` -> ``[B, H, C, dv]``. ``fused``: the Triton kernel
    (workers/models/blocks/dsa_fused.py) instead of gathering the keys in torch; the same numbers."""
    dn, r = q_nope.shape[-1], w_kv.shape[-1]
    q = torch.cat([torch.einsum("bhcd,hdr->bhcr", q_nope, w_kv[:, :dn]), q_rot], dim=-1)  # absorbed: q_nope W_uk
    core = sparse_latent_attention if fused else latent_reference
    return torch.einsum("bhcr,hvr->bhcv", core(q, entry, chosen, scale, r), w_kv[:, dn:])


def attend_latent(q_nope: torch.Tensor, q_rot: torch.Tensor, entry: torch.Tensor, w_kv: torch.Tensor,
                  chosen: torch.Tensor, scale: float, chunk: int, fused: bool = False) -> torch.Tensor:
    """MLA restricted to ``chosen`` int32 ``[B, T, K]`` key positions of ``entry`` (-1: none), ``chunk``
    queries at a time; shapes as :func:`_chunk` with T queries. Returns ``[B, H, T, dv]``.

    Weight absorption: ``q . k_nope = (q_nope W_uk) . latent`` and ``p . v = (p . latent) W_uv``, so
    the gathered keys are the cached latents (``r + dr`` values a key, shared by every head), never
    ``kv_b_proj``'s per-head expansion: a chunk costs ``C x K x (r + dr)`` plus ``H x C x K`` scores."""
    t = q_nope.shape[2]
    keep = torch.is_grad_enabled() and any(x.requires_grad for x in (q_nope, q_rot, entry, w_kv))
    chunk = attention_chunk(chunk, chosen.shape[-1], entry.shape[-1], q_nope.shape[1], entry.element_size(), fused)
    outs = []
    for a in range(0, t, chunk):
        b = min(a + chunk, t)
        args = (q_nope[:, :, a:b], q_rot[:, :, a:b], entry, w_kv, chosen[:, a:b], scale, fused)
        outs.append(checkpoint(_chunk, *args, use_reentrant=False) if keep else _chunk(*args))
    return torch.cat(outs, dim=2)


ATTENTION_BYTES = 1 << 30
"""Bytes one attention chunk may hold (gathered latents and float32 scores; the backward's
recompute about as much again): sets how many queries a chunk takes."""


def attention_chunk(min_chunk: int, k: int, width: int, heads: int, elt: int, fused: bool = False) -> int:
    """Queries per chunk: as many as :data:`ATTENTION_BYTES` allows (``k`` gathered keys of ``width``
    values of ``elt`` bytes each, and three float32 ``heads x k`` score tensors per query; ``fused``:
    nothing per key, the absorbed query, the output and their gradients, ``heads x width`` each), at least
    ``min_chunk`` (``model.dsa_chunk_tokens``). A constant budget: memory stays linear in T, and a
    131k-token row takes a handful of chunks instead of 512 (``dsa_chunk_tokens`` 256)."""
    per_query = max(1, heads * (4 * width * elt + 12) if fused else k * (width * elt + heads * 4 * 3))
    return max(min_chunk, ATTENTION_BYTES // per_query, 1)


def attend_latent_docs(q_nope: torch.Tensor, q_rot: torch.Tensor, entry: torch.Tensor, w_kv: torch.Tensor,
                       docs: Documents, chosen: dict, scale: float, chunk: int, fused: bool = False) -> torch.Tensor:
    """Packed rows: each document attends to its own chosen keys (``chosen[(row, start)]``, positions
    inside the document); a padding run's output is its value (it attends to itself only)."""
    dn = q_nope.shape[-1]

    def run(r: int, a: int, b: int, doc: bool) -> torch.Tensor:
        if not doc:
            return torch.einsum("bsr,hvr->bhsv", entry[r:r + 1, a:b, :w_kv.shape[-1]], w_kv[:, dn:])
        return attend_latent(q_nope[r:r + 1, :, a:b], q_rot[r:r + 1, :, a:b], entry[r:r + 1, a:b], w_kv,
                             chosen[(r, a)], scale, chunk, fused)

    return docs.map_runs(run, time_dim=2)
