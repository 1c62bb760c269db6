"""DeepSeek Sparse Attention under context parallelism, in memory linear in the sequence per rank.

Why: the dense reference path (workers/models/blocks/dsa_indexer.py) scores every (query, key)
pair at once, ``[B, T/cp, H_index, T]`` float32, and hands attention a whole-sequence keep mask
``[B, 1, T, T]``: for GLM-5 at 131,072 tokens that is terabytes of scores and 17 GB per mask on
every rank whatever cp is (after Ulysses' head all-to-all each rank attends every query). Under
cp this file replaces both with the same numbers at bounded size:

1. :func:`choose`: this rank's queries are scored against every (all-gathered) indexer key
   ``CHUNK_PAIRS / T`` queries at a time, each chunk's top ``index_topk`` keys kept, so the float
   scores alive at once are ``CHUNK_PAIRS x H_index``; the chosen key indices ``[B, T/cp, topk]``
   are all-gathered into :class:`SparseKeep` (``[B, T, topk]``: what every rank needs once its
   heads see every query), never a ``[T, T]`` mask.
2. :func:`attend`: softmax attention of queries ``[B, H, n, D]`` (global rows ``lo .. lo+n``)
   over the whole sequence's keys, ``CHUNK_PAIRS / T`` queries at a time, each chunk's mask rows
   rebuilt from the indices inside :func:`torch.utils.checkpoint.checkpoint` so the backward
   rebuilds them too rather than keeping them (softmax is per query: chunking is exact).

Rows and masks follow dsa_indexer.py exactly (a query keeps the keys it may see that are among
its top-k; fewer visible keys than topk keep them all), so tests compare with the dense path.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

from workers.models.blocks import kernels
from workers.models.facts import DSA_CHUNK_PAIRS

CHUNK_PAIRS = DSA_CHUNK_PAIRS
"""(query, key) pairs per chunk: index scores ``CHUNK_PAIRS x H_index x 4`` bytes (4.3 GB for GLM-5's
32 index heads), an attention chunk's mask rows a few bytes per pair. The planner counts the same
(launcher/activations.py)."""


@dataclasses.dataclass
class SparseKeep:
    """Which keys each query of the whole sequence keeps: ``chosen [B, T, topk]`` key indices (a
    query's top-k index scores) within ``visible(lo, n) -> [B, n, S]`` (causal / valid / same document)."""

    chosen: torch.Tensor
    visible: Callable[[int, int], torch.Tensor]

    def rows(self, lo: int, n: int) -> torch.Tensor:
        """``[B, 1, n, S]`` bool keep mask of queries ``lo .. lo+n-1``."""
        allowed = self.visible(lo, n)
        keep = torch.zeros_like(allowed).scatter_(-1, self.chosen[:, lo:lo + n], True)
        return (allowed & keep)[:, None]


def chunk_rows(seq: int) -> int:
    """Queries per chunk against ``seq`` keys."""
    return max(1, CHUNK_PAIRS // max(1, seq))


@torch.no_grad()
def choose(index: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], q: torch.Tensor,
           k: torch.Tensor, w: torch.Tensor, topk: int, visible: Callable[[int, int], torch.Tensor], lo: int,
           gather: Optional[Callable[[torch.Tensor], torch.Tensor]]) -> SparseKeep:
    """Top-``topk`` keys of this rank's queries (``q [B, n, H, D]``, ``w [B, n, H]``, global rows
    ``lo ..``) among ``k [B, S, D]`` (every key), by ``index(q, k, w) -> [B, n, S]`` in chunks;
    ``gather`` all-gathers the chosen indices over the cp ranks (None: this rank's rows are all)."""
    n, s = q.shape[1], k.shape[1]
    step = chunk_rows(s)
    parts = []
    for a in range(0, n, step):
        b = min(n, a + step)
        scores = index(q[:, a:b], k, w[:, a:b]).masked_fill(~visible(lo + a, b - a), float("-inf"))
        parts.append(scores.topk(min(topk, s), dim=-1).indices)
    chosen = torch.cat(parts, dim=1)
    return SparseKeep(chosen=chosen if gather is None else gather(chosen), visible=visible)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: SparseKeep, lo: int,
           scale: Optional[float]) -> torch.Tensor:
    """``q [B, H, n, D]`` (global rows ``lo ..``) over ``k``/``v [B, H, S, D]`` with ``keep``'s rows,
    in query chunks (module docstring); returns ``[B, H, n, Dv]``."""
    n, s = q.shape[2], k.shape[2]
    step = chunk_rows(s)

    def one(qc: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor, a: int) -> torch.Tensor:
        return kernels.attend(qc, kk, vv, keep.rows(lo + a, qc.shape[2]), scale)

    outs = []
    for a in range(0, n, step):
        qc = q[:, :, a:a + step]
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            outs.append(checkpoint(one, qc, k, v, a, use_reentrant=False))
        else:
            outs.append(one(qc, k, v, a))
    return torch.cat(outs, dim=2)


def visible_rows(mask: Optional[torch.Tensor], docs, valid: torch.Tensor) -> Callable[[int, int], torch.Tensor]:
    """``visible(lo, n) -> [B, n, T]``: the keys queries ``lo .. lo+n-1`` of the whole sequence may
    see before sparsity: the forward's mask rows, per document for packed rows, else causal."""
    if mask is not None:
        return lambda lo, n: mask[:, 0, lo:lo + n]
    if docs is not None:
        return docs.causal_rows
    b, t = valid.shape

    def causal(lo: int, n: int) -> torch.Tensor:
        keys = torch.arange(t, device=valid.device)
        rows = keys[None, :] <= torch.arange(lo, lo + n, device=valid.device)[:, None]
        return rows[None].expand(b, n, t)
    return causal
