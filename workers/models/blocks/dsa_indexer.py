"""The DeepSeek Sparse Attention (DSA) indexer of GLM-5: which keys each query may attend to.

A light scorer beside MLA: ``index_n_heads`` query heads of ``index_head_dim`` from the query
latent (``wq_b``), one shared key per token from the hidden state (``wk`` then a LayerNorm
``k_norm``), the first ``qk_rope_head_dim`` channels of both rotated (interleaved layout). A key's
index score for a query is ``sum_h w_h * relu(q_h . k * index_head_dim**-0.5)`` with per-token head
weights ``w = weights_proj(x) * index_n_heads**-0.5``; each query keeps its ``index_topk``
best-scoring keys among those it may see (causal, valid), and attention is masked to them.

Two paths choose the same keys. ``restrict`` is the dense reference (every score computed, the
choice applied as a boolean mask ``[B, 1, T, S]``): quadratic in memory, kept as the reference
(``model.dsa_chunk_tokens=0``). ``choose`` is the memory-linear path: scores one chunk of queries
at a time and keeps only each query's chosen key positions ``[B, T, topk]`` (int32), for
workers/models/blocks/dsa_sparse.py to attend over. The choice is not differentiable, and the
indexer gets no gradient from the language-model loss (transformers runs it under no_grad too;
DSA trains it with its own KL loss, which this project does not implement).

Cache: a layer's indexer keys go to ``cache.index_keys[layer]`` ``[B, T, index_head_dim]`` (time
on dim -2, so the engine's pad/merge/select/trim treat them like attention keys); the static
engine's slots keep them per position beside the MLA latent (its mask already hides stale
positions, so the top-k is chosen among the same keys). GLM-5's
``indexer_types`` may mark a layer ``shared``: it has no indexer and reuses the keep mask of the
last ``full`` layer of the same forward (``ctx.memo``).

Context parallelism (workers/models/blocks/ulysses.py): the indexer is NOT split by heads. Its
score sums over the index heads, so a head split would need an all-reduce of ``[T/cp, T]`` float
scores per layer before top-k (quadratic traffic). Instead each rank keeps its own queries (all
index heads, sequence-sharded, as the rest of the layer) and all-gathers the indexer KEYS: one
``index_head_dim`` vector per token shared by every head (linear traffic, no gradient). It scores
its queries against every key, takes each query's top-k locally (the same numbers as one rank
computes for those rows), and all-gathers the chosen key INDICES ``[B, T/cp, topk]`` so every
rank can build the keep mask rows that attention needs after its head all-to-all. Scoring and
attention run in query chunks there (workers/models/blocks/dsa_cp.py: no ``[T, T]`` mask, memory
linear in T per rank), so :meth:`DsaIndexer.restrict` returns a ``dsa_cp.SparseKeep`` under cp.
"""
from __future__ import annotations

import torch
from torch import nn

from workers.models.blocks import dsa_cp
from workers.models.blocks.decoder import ForwardContext
from workers.models.blocks.dsa_kernels import causal_topk, reference_scores
from workers.models.blocks.dsa_sparse import topk_rows, visible_rows
from workers.models.blocks.rope_scaled import rotate
from workers.models.blocks.ulysses import gather_seq

MEMO_KEY = "dsa_keep"
"""ctx.memo key of the last full indexer's choice (for shared layers): its keep mask ``[B, 1, T, S]``
or per-document masks (dense path), its chosen positions or per-document ones (``choose``)."""


class DsaIndexer(nn.Module):
    def __init__(self, *, hidden_size: int, q_lora_rank: int, num_heads: int, head_dim: int, rope_dim: int,
                 topk: int):  # (the chunk of the memory-linear path is the attention's: MLAttention.dsa_chunk)
        super().__init__()
        self.nh, self.d, self.dr, self.topk = num_heads, head_dim, rope_dim, topk
        self.wq_b = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden_size, num_heads, bias=False)

    @torch.no_grad()
    def restrict(self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 ctx: ForwardContext) -> torch.Tensor:
        """The attention mask ``[B, 1, T, S]`` narrowed to each query's top ``topk`` keys (S: cached + new);
        under context parallelism the same as a ``dsa_cp.SparseKeep`` (indices, rows built on demand)."""
        t = x.shape[1]
        q, k, w = self._project(x, q_latent, cos, sin)
        k = self._with_cache(k, ctx)
        cp = ctx.cp
        if cp is None:
            mask = self._keep(q, k, w, visible(ctx, t, k.shape[1], x.device))[:, None]
        else:  # every token's key; queries stay this rank's, scored in chunks (workers/models/blocks/dsa_cp.py)
            rows = dsa_cp.visible_rows(ctx.mask, ctx.docs, cp.valid)
            # every rank's choice (gathered): attention after the head all-to-all sees every query
            mask = dsa_cp.choose(self._index, q, gather_seq(k, cp), w, self.topk, rows, cp.rank * t,
                                 lambda chosen: gather_seq(chosen, cp))
        ctx.memo[MEMO_KEY] = mask
        return mask

    @torch.no_grad()
    def restrict_docs(self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      ctx: ForwardContext) -> dict:
        """Packed rows (``ctx.docs``): each document's keep mask ``[1, 1, n, n]`` keyed by (row, start),
        its top-k chosen among that document's own earlier keys only. Scores are [n, H, n] per
        document: quadratic within a document (the dense reference of sparse attention), never
        across the packed row."""
        q, k, w = self._project(x, q_latent, cos, sin)
        masks = {}
        for r, runs in enumerate(ctx.docs.runs):
            for a, b, doc in runs:
                if doc:
                    allowed = torch.ones(b - a, b - a, dtype=torch.bool, device=x.device).tril()[None]
                    masks[(r, a)] = self._keep(q[r:r + 1, a:b], k[r:r + 1, a:b], w[r:r + 1, a:b], allowed)[:, None]
        ctx.memo[MEMO_KEY] = masks
        return masks

    @torch.no_grad()
    def choose(self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               ctx: ForwardContext, chunk: int):
        """The memory-linear path (workers/models/blocks/dsa_sparse.py): each query's top ``topk`` key
        positions, int32 ``[B, T, K]`` (-1: none), scored ``chunk`` queries at a time; packed rows
        (``ctx.docs``, no cp): ``{(row, start): [1, n, K]}`` with positions inside each document.
        Under cp: this rank's queries against the gathered keys (global key positions)."""
        t = x.shape[1]
        q, k, w = self._project(x, q_latent, cos, sin)
        k = self._with_cache(k, ctx)
        cp, dev = ctx.cp, x.device

        def pick(qq, kk, ww, rows):
            return topk_rows(lambda a, b: self._index(qq[:, a:b], kk, ww[:, a:b]), rows, qq.shape[1], kk.shape[1],
                             self.topk, chunk)

        def causal(qq, kk, ww, first):  # few large chunks, Triton scores on CUDA (dsa_kernels.py)
            return causal_topk(self._index, qq, kk, ww, scale=self.d ** -0.5, topk=self.topk, first=first,
                               min_chunk=chunk)

        if ctx.docs is not None and cp is None:
            chosen = {(r, a): causal(q[r:r + 1, a:b], k[r:r + 1, a:b], w[r:r + 1, a:b], 0)
                      for r, runs in enumerate(ctx.docs.runs) for a, b, doc in runs if doc}
        elif cp is None and ctx.mask is None:
            chosen = causal(q, k, w, k.shape[1] - t)
        elif cp is None:
            s = k.shape[1]
            chosen = pick(q, k, w, visible_rows(ctx.mask, ctx.docs, x.shape[0], s, s - t, 0, dev))
        else:
            k = gather_seq(k, cp)
            s = k.shape[1]
            rows = visible_rows(ctx.mask, ctx.docs, x.shape[0], s, 0, cp.rank * cp.local_len, dev)
            chosen = pick(q, k, w, rows)  # this rank's queries only: attention gathers the latents instead
        ctx.memo[MEMO_KEY] = chosen
        return chosen

    def _with_cache(self, k: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """This forward's index keys after the cached ones (the cache then holds them all); a static
        cache (fixed slots) returns every position of the key window, masked by the caller."""
        if ctx.cache is not None and ctx.cache.static:
            return ctx.cache.write_index_keys(ctx.layer, k)
        if ctx.cache is not None:
            past = ctx.cache.index_keys[ctx.layer]
            if past is not None:
                k = torch.cat([past, k], dim=1)
            ctx.cache.index_keys[ctx.layer] = k
        return k

    def _project(self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Index queries [B, T, H, D], keys [B, T, D] (rotated) and head weights [B, T, H] (float32)."""
        b, t, _ = x.shape
        q = self.wq_b(q_latent).view(b, t, self.nh, self.d)
        k = self.k_norm(self.wk(x))  # [B, T, D]
        c, s = cos.transpose(1, 2), sin.transpose(1, 2)  # [B, T, 1, dr]: heads on dim 2 here
        q = torch.cat([rotate(q[..., :self.dr], c, s, True), q[..., self.dr:]], dim=-1)
        k = torch.cat([rotate(k[:, :, None, :self.dr], c, s, True)[:, :, 0], k[..., self.dr:]], dim=-1)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.nh ** -0.5  # [B, T, H]
        return q, k, w

    def _index(self, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """[B, T, S] index scores: ``sum_h w_h * relu(q_h . k / sqrt(d))``."""
        return reference_scores(q, k, w, self.d ** -0.5)

    def _keep(self, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """[B, T, S] bool: ``allowed`` keys that are among each query's top ``topk`` index scores."""
        index = self._index(q, k, w).masked_fill(~allowed, float("-inf"))
        chosen = index.topk(min(self.topk, index.shape[-1]), dim=-1).indices
        keep = torch.zeros_like(allowed.expand_as(index)).scatter_(-1, chosen, True)
        return allowed & keep


def visible(ctx: ForwardContext, t: int, s: int, device) -> torch.Tensor:
    """[B, T, S] bool: the keys each query may see before sparsity (ctx.mask; None means plain causal,
    or per document for packed rows under context parallelism: the dense reference path of DSA)."""
    if ctx.mask is not None:
        return ctx.mask[:, 0]
    if ctx.docs is not None:
        return ctx.docs.causal_rows(0, s)
    assert s == t, "a mask-free forward has no cache"
    return torch.ones(t, t, dtype=torch.bool, device=device).tril()[None].expand(ctx.valid.shape[0], t, t)


def shared_mask(ctx: ForwardContext) -> torch.Tensor:
    """A ``shared`` layer's mask: the keep mask of the last full indexer layer of this forward."""
    if MEMO_KEY not in ctx.memo:
        raise ValueError("a DSA layer of indexer type 'shared' needs an earlier 'full' layer in the same forward")
    return ctx.memo[MEMO_KEY]
