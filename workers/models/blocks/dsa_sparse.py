"""Sparse attention over the DSA indexer's choice, in query chunks: memory linear in the sequence.

Why: the dense reference path of DeepSeek Sparse Attention (workers/models/blocks/dsa_indexer.py
``restrict``) scores every (query, key) pair and ANDs a [T, S] keep mask into dense attention:
~2.3 TB at 131,072 tokens for GLM-5. This path never builds a [T, S] tensor:

* the indexer scores one chunk of ``chunk`` queries against every key it may see at a time and
  keeps only each query's top-k key positions, ``chosen`` int32 ``[B, T, K]`` (``K = min(topk,
  S)``), -1 where a query may see fewer than K keys (the dense path drops those too);
* attention (:func:`attend_chosen`) gathers, for one chunk of queries, the chosen keys and values
  ``[B, C, K, H, D]`` and takes the softmax over those K only: O(chunk x K x H x D) at a time.

Exactness: the indexer's rows are the dense path's rows (same scores, same top-k per row), and a
softmax over the K chosen keys equals a softmax over all keys with the others masked out; only
the order of the float sums differs (fp32: ~1e-7 relative).

Gradients: the choice is not differentiable (the indexer runs under no_grad in both paths: the LM
loss trains it not at all, as in transformers). The attention of each chunk runs under
non-reentrant activation checkpointing, so the backward keeps only its inputs (views of q, k, v
and the chunk's indices) and recomputes the gathered keys/values one chunk at a time; the
gathers' backward scatters into ``[B, S, H, D]`` gradients (linear).

Where it runs (``MLAttention.dsa_chunk`` > 0, GLM-5's ``model.dsa_chunk_tokens``): plain and
left-padded rows (the chosen rows read ``ctx.mask`` a chunk at a time), packed rows (per
document, :func:`attend_docs_chosen`), context parallelism (workers/models/blocks/ulysses.py runs
:func:`attend_selected` after its all-to-all, every rank holding the whole sequence's choice) and
the embedded engine's prefill and decode (the cache's keys are the key axis).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

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


def _gathered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chosen: torch.Tensor, scale: float) -> torch.Tensor:
    """One chunk: ``q [B, H, C, D]`` over its chosen keys of ``k/v [B, H, S, D]`` -> ``[B, H, C, Dv]``."""
    batch = torch.arange(q.shape[0], device=q.device)[:, None, None]
    idx = chosen.clamp(min=0).long()
    kg = k.transpose(1, 2)[batch, idx]  # [B, C, K, H, D]
    vg = v.transpose(1, 2)[batch, idx]
    scores = torch.einsum("bhcd,bckhd->bhck", q, kg) * scale
    # a finite floor, not -inf: a row with nothing chosen (a padded query) stays finite; chosen rows lose nothing
    scores = scores.float().masked_fill((chosen < 0)[:, None], torch.finfo(torch.float32).min)
    return torch.einsum("bhck,bckhd->bhcd", scores.softmax(-1).to(v.dtype), vg)


def attend_selected(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chosen: torch.Tensor, scale: float,
                    chunk: int) -> torch.Tensor:
    """Attention of ``q [B, H, T, D]`` over ``k``/``v [B, H, S, D]`` restricted to ``chosen`` int32
    ``[B, T, K]`` key positions (-1: none), ``chunk`` queries at a time. Returns ``[B, H, T, Dv]``."""
    t = q.shape[2]
    keep = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    outs = []
    for a in range(0, t, chunk):
        b = min(a + chunk, t)
        args = (q[:, :, a:b], k, v, chosen[:, a:b], scale)
        outs.append(checkpoint(_gathered, *args, use_reentrant=False) if keep else _gathered(*args))
    return torch.cat(outs, dim=2)


def attend_docs_chosen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, chosen: dict,
                       scale: float, chunk: int) -> torch.Tensor:
    """Packed rows: each document attends to its own chosen keys (``chosen[(row, start)]``, positions
    inside the document); padding runs attend to themselves only (their output is their value)."""
    def run(r: int, a: int, b: int, doc: bool) -> torch.Tensor:
        if not doc:
            return v[r:r + 1, :, a:b]
        return attend_selected(q[r:r + 1, :, a:b], k[r:r + 1, :, a:b], v[r:r + 1, :, a:b], chosen[(r, a)], scale, chunk)

    return docs.map_runs(run, time_dim=2)

