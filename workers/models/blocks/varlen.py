"""Packed documents: attention and scans per document, linear in memory (no [T, T] mask).

Why: a packed training row holds several samples ("documents") back to back, and agentic
samples reach 131,072 tokens. A dense block-diagonal mask is [T, T] (16 GiB of bool at 131k,
and SDPA's masked kernels keep an [H, T, T] score matrix for the backward); per-document causal
attention is what the math asks for and costs O(T) memory with a flash kernel.

:class:`Documents` is the contract: built once per forward from ``segment_ids`` [B, T] (sample
index per position, -1 on padding; workers/trainer/packing.py), it lists the RUNS of each row
(maximal spans of one segment id) and the flat ``cu_seqlens`` of the varlen kernels. Every
layer kind reads it from ``ForwardContext.docs``:

* softmax attention (GQA, MLA, NoPE): :func:`attend_docs` - on CUDA in bf16/fp16 torch's
  ``varlen_attn`` over the flat [B*T] stream (one launch), elsewhere one causal SDPA per document
  (CPU SDPA's flash kernel keeps O(T) memory when q, k and v have one head dim, so unequal MLA
  dims are zero-padded to one; the scale stays the caller's);
* sparse attention (DSA): ``doc_masks`` gives each document its own keep mask (the indexer's
  top-k never looks across a document boundary); those documents take SDPA's masked path;
* Mamba-2: :meth:`Documents.map_runs` runs the mixer once per document from a zero state (the
  ``seq_idx`` semantics of the Mamba-2 kernels: state and conv window reset at every start).

Padding runs (segment -1) attend to themselves only (their output is their value), as the dense
mask made them do: nothing valid depends on them, and they never produce NaN.

A context-parallel layer calls the same functions after its all-to-all: they are pure functions
of (q, k, v, documents, scale), positions being applied by the caller (rotary) beforehand.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from workers.models.blocks.masking import causal_mask, narrows, window_band, with_sinks


@dataclasses.dataclass
class Documents:
    """The runs of a packed batch: ``runs[r]`` lists ``(start, end, is_doc)`` covering row r's [0, T)."""

    segment_ids: torch.Tensor  # [B, T] int64, -1 on padding
    runs: list[list[tuple[int, int, bool]]]
    cu: Optional[torch.Tensor] = None
    """int32 [R + 1] on the ids' device: :meth:`cu_seqlens`, built once per forward (dim 0 dynamic)."""
    max_len_like: Optional[torch.Tensor] = None
    """A tiny host tensor of shape ``[max_len]``: the longest run as a SHAPE, so a compiled layer reads
    it as a symbol (no guard on its value, no recompile per packing layout; dim 0 dynamic)."""

    @classmethod
    def from_segments(cls, segment_ids: torch.Tensor) -> "Documents":
        """One host copy of the ids (a sync per forward), then pure Python over the run boundaries."""
        ids = segment_ids.detach().cpu()
        runs: list[list[tuple[int, int, bool]]] = []
        for r in range(ids.shape[0]):
            row = ids[r]
            cuts = (torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist()
            bounds = [0, *cuts, row.numel()]
            spans = [(a, b, int(row[a]) >= 0) for a, b in zip(bounds[:-1], bounds[1:])]
            seen = [int(row[a]) for a, _, doc in spans if doc]
            if len(seen) != len(set(seen)):
                raise ValueError(f"segment_ids row {r}: a segment is split by another (documents must be contiguous)")
            runs.append(spans)
        docs = cls(segment_ids=segment_ids, runs=runs)
        _varlen_fn()  # resolved here, eagerly: a compiled layer only reads the result
        docs.cu = docs.cu_seqlens(segment_ids.device)
        docs.max_len_like = torch.empty(max(docs.max_len, 1), dtype=torch.uint8)
        for t in (docs.cu, docs.max_len_like):  # the counts differ every batch: symbols from the first trace
            torch._dynamo.maybe_mark_dynamic(t, 0)
        return docs

    @property
    def max_len(self) -> int:
        return max((b - a for row in self.runs for a, b, _ in row), default=0)

    def cu_seqlens(self, device) -> torch.Tensor:
        """int32 [R + 1] run boundaries in the flat [B * T] stream (padding runs included: each is
        one more causal sequence whose outputs nobody reads)."""
        t = self.segment_ids.shape[1]
        cuts = [0] + [r * t + b for r, row in enumerate(self.runs) for _, b, _ in row]
        return torch.tensor(cuts, dtype=torch.int32, device=device)

    def causal_rows(self, start: int, n: int) -> torch.Tensor:
        """bool [B, n, T]: what queries ``start .. start+n-1`` may see (same document, causal; a padding
        position itself only). Dense, for the paths that need a mask: context parallelism's gathered
        keys (n = T / cp rows) and the DSA indexer's reference scoring."""
        seg = self.segment_ids
        t = seg.shape[1]
        q = torch.arange(start, start + n, device=seg.device)
        keys = torch.arange(t, device=seg.device)
        qs = seg[:, start:start + n]
        same = (qs[:, :, None] == seg[:, None, :]) & (qs >= 0)[:, :, None]
        return (same & (keys[None, None, :] <= q[None, :, None])) | (keys[None, None, :] == q[None, :, None])

    @torch.compiler.disable  # the runs differ every packed batch: not traced (see attend_docs)
    def map_runs(self, fn: Callable[[int, int, int, bool], torch.Tensor], time_dim: int = 1) -> torch.Tensor:
        """``fn(row, start, end, is_doc)`` -> that run's output (batch 1 on dim 0, time on
        ``time_dim``), concatenated back to the whole batch."""
        rows = [torch.cat([fn(r, a, b, doc) for a, b, doc in row], dim=time_dim) for r, row in enumerate(self.runs)]
        return torch.cat(rows, dim=0)


def attend_docs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, scale: Optional[float] = None,
                doc_masks: Optional[dict] = None, *, window: Optional[int] = None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention inside each document of ``q/k/v`` [B, H, T, D] (k and v with q's heads;
    v's head dim may differ). ``doc_masks`` {(row, start): bool [1, 1, n, n]} replaces the causal
    rule of those documents (sparse attention). ``window``: each query sees its document's last
    ``window`` keys only; ``sinks`` [H]: a sink logit per head (workers/models/blocks/masking.py;
    both exact in every path below, the one-launch kernel taking the window natively and leaving
    sinks to the per-document path). Returns [B, H, T, Dv].

    Inside a compiled layer (trainer.compile) the boundaries are tensors, so neither path below
    breaks the graph nor guards on the packing layout: the varlen kernel reads ``docs.cu`` and the
    longest run as a symbolic shape; on CPU a compiled layer builds the block-diagonal causal mask
    from ``docs.segment_ids`` (O(T^2): small compiled runs and tests only; on CPU
    ``trainer.compile=auto`` does not compile). Eager, on CUDA without the varlen kernel (float32),
    or with ``doc_masks``: one SDPA per document (linear memory), outside the graph.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if doc_masks is None and sinks is None and varlen_ok(q, v, window):
        return _varlen(q, k, v, docs.cu if docs.cu is not None else docs.cu_seqlens(q.device),
                       docs.max_len_like.shape[0] if docs.max_len_like is not None else docs.max_len, scale, window)
    if doc_masks is None and torch.compiler.is_compiling() and not q.is_cuda:
        mask = block_causal_mask(docs.segment_ids)
        if window is not None:
            pos = torch.arange(mask.shape[-1], device=mask.device)
            mask = mask & window_band(pos, pos, window)
        return causal_sdpa(q, k, v, scale, mask[:, None], sinks=sinks)
    return _per_document(q, k, v, docs, scale, doc_masks, window, sinks)


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """bool [B, T, T] from ``segment_ids`` alone (no host sync): same segment and causal; a padding
    position (segment -1) sees itself only. :meth:`Documents.causal_rows` over the whole rows."""
    t = segment_ids.shape[1]
    pos = torch.arange(t, device=segment_ids.device)
    same = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids >= 0)[:, :, None]
    return (same & (pos[None, None, :] <= pos[None, :, None])) | (pos[None, None, :] == pos[None, :, None])


# Not traced by torch.compile: the document runs are Python lists that differ every packed batch, and
# dynamo would guard on them and recompile per batch. The one path that still breaks the graph: eager
# per-document attention (CPU reference) and sparse attention's per-document masks.
@torch.compiler.disable
def _per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, scale: float,
                  doc_masks: Optional[dict], window: Optional[int] = None,
                  sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    def run(r: int, a: int, b: int, doc: bool) -> torch.Tensor:
        if not doc:
            return v[r:r + 1, :, a:b]  # padding attends to itself only
        mask = None if doc_masks is None else doc_masks.get((r, a))
        x = (q[r:r + 1, :, a:b], k[r:r + 1, :, a:b], v[r:r + 1, :, a:b])
        if narrows(window, b - a) and mask is None:
            return windowed_sdpa(*x, scale, window, sinks)
        if narrows(window, b - a):
            mask = mask & causal_mask(b - a, q.device, window)[None, None]
        return causal_sdpa(*x, scale, mask, sinks=sinks)

    return docs.map_runs(run, time_dim=2)


WINDOW_BLOCK = 256
"""Queries per block of :func:`windowed_sdpa` (at least the window)."""


def windowed_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int,
                  sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal sliding-window attention over ``[B, H, T, D]`` without a [T, T] mask: queries in blocks of
    ``n = max(window, WINDOW_BLOCK)``, block ``[a, a + n)`` against keys ``[a - window + 1, a + n)``
    under their band, so memory is O(T x (n + window)). What the paths without a windowed kernel run
    (CPU, float32): long documents keep linear memory as on the GPU's varlen kernel."""
    t, n = q.shape[-2], max(window, WINDOW_BLOCK)
    out = []
    for a in range(0, t, n):
        b, lo = min(a + n, t), max(0, a - window + 1)
        rows, keys = torch.arange(a, b, device=q.device), torch.arange(lo, b, device=q.device)
        mask = (keys[None, :] <= rows[:, None]) & window_band(rows, keys, window)
        out.append(causal_sdpa(q[..., a:b, :], k[..., lo:b, :], v[..., lo:b, :], scale, mask[None, None], sinks=sinks))
    return torch.cat(out, dim=-2)


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                mask: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal SDPA (or SDPA under ``mask``) with q/k and v head dims made equal by zero padding, so
    the fused (flash) kernel applies: zero channels add nothing to q.k, and padded value channels
    are cut off the output. ``sinks`` [H]: a sink key per head (masking.with_sinks; needs a mask)."""
    if sinks is not None:
        mask = causal_mask(q.shape[-2], q.device)[None, None] if mask is None else mask
        q, k, v, mask = with_sinks(q, k, v, mask, sinks, scale)
    dq, dv = q.shape[-1], v.shape[-1]
    if dv < dq:
        v = F.pad(v, (0, dq - dv))
    elif dq < dv:
        q, k = F.pad(q, (0, dv - dq)), F.pad(k, (0, dv - dq))
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out[..., :dv]


_VARLEN: Optional[Callable] = None
_VARLEN_CAUSAL: dict = {}


def _varlen_fn() -> Optional[Callable]:
    """torch's varlen flash attention, or None where this torch has none (or one without ``scale``).
    Its causal switch moved between releases: ``is_causal=True`` (older) or ``window_size=(-1, 0)``."""
    global _VARLEN
    if _VARLEN is None:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            _VARLEN = False
            return None
        params = inspect.signature(varlen_attn).parameters
        if "scale" not in params or not ({"is_causal", "window_size"} & set(params)):
            _VARLEN = False  # a prototype without the arguments used here: per-document SDPA instead
            return None
        _VARLEN_CAUSAL.update({"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)})
        _VARLEN = varlen_attn
    return _VARLEN or None


def varlen_ok(q: torch.Tensor, v: torch.Tensor, window: Optional[int] = None) -> bool:
    """The one-launch varlen kernel applies (CUDA, half precision, a torch that has it; with a
    sliding ``window``, one whose kernel takes ``window_size``)."""
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and _varlen_fn() is not None
            and (window is None or "window_size" in _VARLEN_CAUSAL))


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """Causal sliding-window attention over whole rows [B, H, T, D] in one varlen launch (each row
    one sequence), instead of a [T, T] mask: the plain causal path of a windowed layer on the GPU."""
    b, t = q.shape[0], q.shape[2]
    cu = torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=q.device)
    return _varlen(q, k, v, cu, t, scale, window)


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float,
            window: Optional[int] = None) -> torch.Tensor:
    """One varlen launch over the flat stream [B*T, H, D] (heads padded to one head dim, as above);
    ``window``: flash attention's ``window_size=(window - 1, 0)`` (the query and window - 1 keys before it)."""
    b, h, t, dq = q.shape
    dv = v.shape[-1]
    width = max(dq, dv)
    flat = [F.pad(x, (0, width - x.shape[-1])).transpose(1, 2).reshape(b * t, h, width) for x in (q, k, v)]
    causal = _VARLEN_CAUSAL if window is None else {"window_size": (window - 1, 0)}
    out = _varlen_fn()(*flat, cu, cu, max_len, max_len, scale=scale, **causal)
    return out.view(b, t, h, width)[..., :dv].transpose(1, 2)
