"""Ulysses context parallelism: one sequence split over ``cp`` ranks, attention over all of it by heads.

Each rank of a context-parallel group holds a contiguous chunk of ``T / cp`` tokens of every row
(rank r: positions ``[r*T/cp, (r+1)*T/cp)``) and runs every per-token op (embeddings, norms,
projections, rotary at the tokens' GLOBAL positions, MLPs, experts, the head) on its chunk only.
A mixer that needs the whole sequence (softmax attention, the Mamba-2 scan and its conv1d) swaps
the split around it with one all-to-all: sequence-sharded, all heads ``[B, H, T/cp, D]`` ->
head-sharded, whole sequence ``[B, H/cp, T, D]``; it runs unchanged on its heads; the inverse
all-to-all brings the output back to the rank's tokens. Heads are independent in attention and
in the scan, so this is exact when ``cp`` divides the number of heads. Attention with fewer heads
(H % cp != 0) falls back to gathering the keys and values (:func:`attend_gathered`: each rank's
queries against the whole sequence's keys; no ring attention); the Mamba-2 scan has no such
fallback, so the plan refuses a cp that does not divide its heads (launcher/resources.py).

Where several heads share one input (GQA's key/value heads, Mamba-2's B/C groups) and their count
is not a multiple of ``cp``, :func:`spread_groups` repeats each group just enough times (keeping
which head reads which group) that the groups split evenly; when the count divides, nothing is
copied and each rank receives only the groups its heads read.

Autograd: :class:`_AllToAll`'s backward is the inverse all-to-all of the gradient (an all-to-all
is a permutation of blocks between ranks), so gradients reach the rank that produced each input.
torch 2.13's gloo implements ``all_to_all_single`` on CPU (checked), which is what this uses.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.distributed as dist

from workers.models.blocks import dsa_cp, kernels
from workers.models.blocks.masking import window_band
from workers.models.blocks.varlen import Documents


@dataclasses.dataclass
class SeqShard:
    """This rank's place in its context-parallel group, and the whole-sequence facts a layer needs.

    ``valid`` / ``segment_ids`` are ``[B, T]`` over the WHOLE (padded) sequence: attention masks and
    the Mamba pad masks are built from them after the all-to-all, when a rank sees every position.
    """

    group: Optional[dist.ProcessGroup]
    size: int
    rank: int
    valid: torch.Tensor
    segment_ids: Optional[torch.Tensor] = None

    @property
    def local_len(self) -> int:
        return self.valid.shape[1] // self.size

    def local(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's chunk of a whole-sequence tensor along ``dim``."""
        return x.narrow(dim, self.rank * self.local_len, self.local_len)


class _AllToAll(torch.autograd.Function):
    """Split ``x`` into ``size`` chunks along ``scatter_dim``, send chunk j to rank j, concatenate
    what arrives (in rank order) along ``gather_dim``. Backward: the same with the dims swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, size: int, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.size, ctx.dims = group, size, (scatter_dim, gather_dim)
        return _all_to_all(x, group, size, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, ctx.size, gather_dim, scatter_dim), None, None, None, None


def _all_to_all(x: torch.Tensor, group, size: int, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    assert x.shape[scatter_dim] % size == 0, (tuple(x.shape), scatter_dim, size)
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()  # [size, ...chunk]: row j goes to rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


def seq_to_heads(x: torch.Tensor, cp: SeqShard, head_dim: int, seq_dim: int) -> torch.Tensor:
    """This rank's tokens of every head -> this rank's heads (a contiguous 1/cp of them) for every token."""
    return _AllToAll.apply(x, cp.group, cp.size, head_dim, seq_dim)


def heads_to_seq(x: torch.Tensor, cp: SeqShard, head_dim: int, seq_dim: int) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`: back to this rank's tokens of every head."""
    return _AllToAll.apply(x, cp.group, cp.size, seq_dim, head_dim)


def spread_groups(x: torch.Tensor, num_groups: int, num_heads: int, cp: int, dim: int) -> tuple[torch.Tensor, int]:
    """Repeat each of ``num_groups`` shared inputs (kv heads, B/C groups) along ``dim`` so that the
    count is a multiple of ``cp`` while head ``h`` still reads repeated group ``h // (heads per group)``.

    Head h reads group ``h // g`` (``g = num_heads / num_groups``). Repeating every group
    ``rep = cp / gcd(num_groups, cp)`` times (``rep`` divides ``g`` because cp divides num_heads)
    makes ``num_groups * rep`` groups of ``g / rep`` heads each; returns ``(x, groups after)``.
    """
    rep = cp // math.gcd(num_groups, cp)
    if rep == 1:
        return x, num_groups
    assert (num_heads // num_groups) % rep == 0, (num_groups, num_heads, cp)
    return x.repeat_interleave(rep, dim=dim), num_groups * rep


@torch.no_grad()
def gather_seq(x: torch.Tensor, cp: SeqShard, dim: int = 1) -> torch.Tensor:
    """Every rank's chunk concatenated along ``dim`` (no gradient: for the DSA indexer's choice)."""
    parts = [torch.empty_like(x) for _ in range(cp.size)]
    dist.all_gather(parts, x.contiguous(), group=cp.group)
    return torch.cat(parts, dim=dim)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], cp: SeqShard,
           scale: Optional[float] = None, docs: Optional[Documents] = None, *, window: Optional[int] = None,
           sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Softmax attention of this rank's tokens over the whole sequence: ``q [B, H, T/cp, D]``,
    ``k``/``v [B, Hkv, T/cp, D]`` (query head h reads kv head ``h // (H / Hkv)``), ``mask`` over the
    whole sequence ``[B, 1, T, T]`` or None (plain causal), or a DSA layer's ``dsa_cp.SparseKeep``
    (chosen key indices, mask rows built per query chunk). Returns ``[B, H, T/cp, Dv]``.

    The kv heads travel as they are when cp divides their number (rank r gets exactly the ones its
    query heads read); otherwise :func:`spread_groups` repeats them first, never more than needed.
    With fewer heads than cp (H % cp != 0) Ulysses cannot split them: :func:`attend_gathered`.
    ``docs`` (packed rows, whole-sequence documents; ``mask`` None): after the all-to-all each rank
    attends per document on its heads (workers/models/blocks/varlen.py), no [T, T] mask.
    ``window`` / ``sinks`` as in :func:`kernels.attend` (a given ``mask`` is already banded; the sink
    logits ``[H]`` of this rank's heads, a contiguous 1/cp of them, go with its heads).
    """
    nh = q.shape[1]
    if nh % cp.size:
        return attend_gathered(q, k, v, mask, cp, scale, docs, window=window, sinks=sinks)
    k, groups = spread_groups(k, k.shape[1], nh, cp.size, dim=1)
    v, _ = spread_groups(v, v.shape[1], nh, cp.size, dim=1)
    q, k, v = (seq_to_heads(x, cp, head_dim=1, seq_dim=2) for x in (q, k, v))
    if groups != nh:  # this rank's query head j reads its kv head j // (H / groups)
        k = k.repeat_interleave(nh // groups, dim=1)
        v = v.repeat_interleave(nh // groups, dim=1)
    if isinstance(mask, dsa_cp.SparseKeep):  # DSA: every query's kept keys, in query chunks
        return heads_to_seq(dsa_cp.attend(q, k, v, mask, 0, scale), cp, head_dim=1, seq_dim=2)
    if sinks is not None:  # this rank's query heads: the contiguous chunk seq_to_heads gave it
        sinks = sinks.narrow(0, cp.rank * (nh // cp.size), nh // cp.size)
    out = kernels.attend(q, k, v, mask, scale, docs=docs, window=window, sinks=sinks)
    return heads_to_seq(out, cp, head_dim=1, seq_dim=2)


def attend_gathered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], cp: SeqShard,
                    scale: Optional[float] = None, docs: Optional[Documents] = None, *,
                    window: Optional[int] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`attend` for models with too few heads for Ulysses (H % cp != 0): every rank all-gathers
    the keys and values of the whole sequence (the all-gather form of context parallelism; ring
    attention would pass them around instead) and attends with its own queries, all heads. Keys
    and values cost ``T x Hkv x D`` per rank (linear in T; the queries, scores and outputs stay
    the chunk's). Backward: each rank's key/value gradients for every position are summed onto the
    rank that owns the position (a reduce-scatter, through all-to-all)."""
    nh, lo, t = q.shape[1], cp.rank * cp.local_len, cp.local_len
    k, v = _GatherSeq.apply(k, cp.group, cp.size, 2), _GatherSeq.apply(v, cp.group, cp.size, 2)
    if isinstance(mask, dsa_cp.SparseKeep):  # DSA: this chunk's queries' kept keys, in query chunks
        if k.shape[1] != nh:
            k, v = k.repeat_interleave(nh // k.shape[1], dim=1), v.repeat_interleave(nh // v.shape[1], dim=1)
        return dsa_cp.attend(q, k, v, mask, lo, scale)
    if mask is None:  # packed rows / plain causal over the whole sequence: this chunk's rows of it
        keys, rows = torch.arange(k.shape[2], device=q.device), torch.arange(lo, lo + t, device=q.device)
        mask = docs.causal_rows(lo, t)[:, None] if docs is not None else (keys[None, :] <= rows[:, None])[None, None]
        if window is not None:  # documents are contiguous: row distance is in-document distance
            mask = mask & window_band(rows, keys, window)
    else:
        mask = mask.narrow(2, lo, t)
    if k.shape[1] != nh:  # query head h reads kv head h // (H / Hkv)
        k = k.repeat_interleave(nh // k.shape[1], dim=1)
        v = v.repeat_interleave(nh // v.shape[1], dim=1)
    return kernels.attend(q, k, v, mask, scale, sinks=sinks)


def gather_seq_grad(x: torch.Tensor, cp: SeqShard, dim: int = 1) -> torch.Tensor:
    """Every rank's chunk concatenated along ``dim``, with gradients: each position's gradient is
    summed over the ranks that read it, onto the rank that owns it (DSA's latent keys, dsa_sparse.py)."""
    return _GatherSeq.apply(x, cp.group, cp.size, dim)


class _GatherSeq(torch.autograd.Function):
    """All-gather along ``dim`` (rank order); backward: the sum over ranks of each rank's gradient
    for this rank's chunk (one all-to-all of the chunks, then a sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, size: int, dim: int) -> torch.Tensor:
        ctx.group, ctx.size, ctx.dim = group, size, dim
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        send = torch.stack(grad.chunk(ctx.size, dim=ctx.dim)).contiguous()  # row j: rank j's chunk
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=ctx.group)
        return recv.sum(0), None, None, None
