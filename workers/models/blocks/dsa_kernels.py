"""DSA's causal top-k key choice in few, large query chunks, with a Triton index-score kernel on CUDA.

Why: GLM-5's memory-linear sparse path (workers/models/blocks/dsa_sparse.py) scored
``model.dsa_chunk_tokens`` (256) queries at a time against EVERY key: 512 Python iterations per
layer at 131,072 tokens, each materialising ``[B, C, H_index, S]`` float32 scores (relu, then a
weighted sum over the index heads) and a ``[B, C, S]`` bool mask, and half of every row masked
out afterwards (causal). The H200 measured 20.5 s for one 131k-token step of the tiny GLM-5.

Here, for the causal choice (plain rows, and each document of a packed row):

* a chunk holds as many queries as :data:`SCORE_PAIRS` (query, key) float scores allow
  (``max(dsa_chunk_tokens, SCORE_PAIRS // S)``: 2,048 queries at 131k keys, all of them at 8k), so
  memory stays bounded by a constant budget per chunk plus the ``[B, T, K]`` choice: linear in T;
* a chunk of queries ``[a, b)`` scores only keys ``< first + b`` (the others are all in its
  future), which halves the work over a row;
* on CUDA the scores come from :func:`_index_kernel`: per ``[BLOCK_M, BLOCK_N]`` tile it sums
  ``w_h * relu(q_h . k * scale)`` over the index heads in registers and writes ``-inf`` where the
  key is in the query's future: one float32 write per pair instead of ``H`` plus the mask passes.
  With bf16 (or fp16) index queries and keys (the bf16 model) its dot products run on the tensor
  cores with bf16 inputs and float32 accumulation: a product of two bf16 values is exact in float32,
  so this differs from the reference's ``float()`` upcast (transformers' GlmMoeDsaIndexer) only in
  the order of the float32 sums (~1e-7 relative; keys within that of each other may swap places in
  the top-k). The H100 measured 13-14 TF/s for the float32 dots (5.5 of the 8.3 s of a GLM-5 layer at
  131k tokens); tensor cores run bf16 dots more than 10x faster. float32 inputs keep IEEE float32
  dots (no TF32 rounding). Block sizes are autotuned on CUDA among a few configurations (once per
  head count, head width and dtype). tests/unit/models/test_dsa_kernels.py runs it under Triton's
  interpreter on CPU against the torch reference (:func:`reference_scores`, the indexer's formula),
  in float32 and in bf16.

The choice is ``torch.topk`` over each chunk's rows (``-1`` where fewer than K keys are visible),
as before. Not differentiable (the indexer runs under no_grad).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

SCORE_PAIRS = 1 << 28
"""(query, key) float32 index scores alive at once per chunk: 1 GiB."""

try:  # Triton ships with CUDA builds of torch; absent (or unusable) on CPU-only installs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None

IndexFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``index(q [B, C, H, D], k [B, S, D], w [B, C, H]) -> [B, C, S]`` float32 index scores."""


def reference_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    """``[B, C, S]``: ``sum_h w_h * relu(q_h . k * scale)`` in float32 (the indexer's formula)."""
    scores = torch.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * scale)  # [B, C, H, S]
    return torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)


def chunk_queries(keys: int, min_chunk: int, heads: int = 1) -> int:
    """Queries per chunk against ``keys`` keys: the :data:`SCORE_PAIRS` budget, at least ``min_chunk``
    (``heads``: the torch reference holds ``heads`` scores per pair before summing them; the kernel one)."""
    return max(min_chunk, SCORE_PAIRS // max(keys * heads, 1), 1)


def use_kernel(q: torch.Tensor) -> bool:
    """The Triton kernel applies: CUDA tensors and a torch build with Triton (or its CPU interpreter,
    ``TRITON_INTERPRET=1``, for the tests)."""
    import os

    return triton is not None and (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


# Not traced by torch.compile (trainer.compile=layers): a Python loop over budget-sized chunks whose count
# follows the sequence length, launching a user Triton kernel; one graph break per DSA layer instead.
@torch.compiler.disable
@torch.no_grad()
def causal_topk(index: IndexFn, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, *, scale: float, topk: int,
                first: int, min_chunk: int, kernel: Optional[bool] = None) -> torch.Tensor:
    """int32 ``[B, T, min(topk, S)]``: each query's best keys, query ``i`` seeing keys ``<= first + i``
    (``first``: the position of query 0 among the keys, e.g. the cached length), -1 where fewer are
    visible. ``q [B, T, H, D]``, ``k [B, S, D]``, ``w [B, T, H]`` float32; ``index`` is the torch
    scorer used where the kernel does not apply (``kernel`` None: :func:`use_kernel`)."""
    b, t = q.shape[:2]
    s = k.shape[1]
    kk = min(topk, s)
    kernel = use_kernel(q) if kernel is None else kernel
    out = torch.empty(b, t, kk, dtype=torch.int32, device=q.device)
    step = chunk_queries(s, min_chunk, 1 if kernel else q.shape[2])
    for a in range(0, t, step):
        e = min(a + step, t)
        width = min(s, max(first + e, kk))  # keys past the chunk's last query are all in its future
        if kernel:
            scores = index_scores(q[:, a:e], k[:, :width], w[:, a:e], scale, first + a)
        else:
            scores = index(q[:, a:e], k[:, :width], w[:, a:e])
            qpos = torch.arange(first + a, first + e, device=q.device)
            future = torch.arange(width, device=q.device)[None, :] > qpos[:, None]
            scores = scores.masked_fill(future[None], float("-inf"))
        vals, idx = scores.topk(kk, dim=-1)
        out[:, a:e] = torch.where(vals > float("-inf"), idx, -1).to(torch.int32)
    return out


def index_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, scale: float, first: int) -> torch.Tensor:
    """The kernel: float32 ``[B, C, S]`` index scores of ``q [B, C, H, D]`` against ``k [B, S, D]``
    with head weights ``w [B, C, H]``, ``-inf`` where key ``j > first + i``. bf16/fp16 ``q`` and ``k``
    (the same dtype) take tensor-core dots with float32 accumulation; anything else float32 IEEE dots."""
    b, c, h, d = q.shape
    s = k.shape[1]
    # Triton's CPU interpreter (3.9) returns garbage for bf16 tl.dot: there the same exact products in float32
    if q.dtype != k.dtype or q.dtype not in (torch.bfloat16, torch.float16) or not q.is_cuda:
        q, k = q.float(), k.float()
    out = torch.empty(b, c, s, dtype=torch.float32, device=q.device)
    w = w.float()
    args = (q, k, w, out, c, s, first, scale, q.stride(0), q.stride(1), q.stride(2), q.stride(3), k.stride(0),
            k.stride(1), k.stride(2), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
            out.stride(2))
    dims = dict(H=h, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32")  # tf32: ignored by bf16 dots
    if q.is_cuda:
        _index_tuned[lambda meta: (triton.cdiv(c, meta["BLOCK_M"]), triton.cdiv(s, meta["BLOCK_N"]), b)](*args, **dims)
    else:  # Triton's CPU interpreter (the tests): one small configuration
        _index_kernel[(triton.cdiv(c, 32), triton.cdiv(s, 32), b)](*args, **dims, BLOCK_M=32, BLOCK_N=32)
    return out


if triton is not None:
    # Chunk sizes and offsets differ per chunk: no value specialisation, so a long row compiles nothing new.
    @triton.jit(do_not_specialize=["n_q", "n_k", "first"])
    def _index_kernel(q_ptr, k_ptr, w_ptr, o_ptr, n_q, n_k, first, scale,
                      sqb, sqm, sqh, sqd, skb, skn, skd, swb, swm, swh, sob, som, son,
                      H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_m, pid_n, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        in_m, in_n, in_d = offs_m < n_q, offs_n < n_k, offs_d < D
        visible = offs_n[None, :] <= (first + offs_m)[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if pid_n * BLOCK_N <= first + pid_m * BLOCK_M + BLOCK_M - 1:  # else: the whole tile is in the future
            # the keys' tile stays in its own dtype: bf16 dots accumulate in float32 (exact products)
            kt = tl.load(k_ptr + pid_b * skb + offs_n[None, :] * skn + offs_d[:, None] * skd,
                         mask=in_n[None, :] & in_d[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
            q_rows = q_ptr + pid_b * sqb + offs_m[:, None] * sqm + offs_d[None, :] * sqd
            for hh in range(H):
                qh = tl.load(q_rows + hh * sqh, mask=in_m[:, None] & in_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
                dots = tl.dot(qh, kt, input_precision=PRECISION, out_dtype=tl.float32)
                wh = tl.load(w_ptr + pid_b * swb + offs_m * swm + hh * swh, mask=in_m, other=0.0)
                acc += wh[:, None] * tl.maximum(dots * scale, 0.0)
        acc = tl.where(visible, acc, float("-inf"))
        tl.store(o_ptr + pid_b * sob + offs_m[:, None] * som + offs_n[None, :] * son, acc,
                 mask=in_m[:, None] & in_n[None, :])

    # A few Hopper-sane tiles (a [BLOCK_M, BLOCK_N] float32 accumulator plus one head's dots, the keys'
    # [D, BLOCK_N] tile resident, one head's queries streamed per step): tuned once per (H, D, dtype).
    _index_tuned = triton.autotune(
        [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=wp, num_stages=st)
         for bm, bn, wp, st in ((64, 128, 4, 3), (128, 128, 8, 3), (64, 256, 8, 3))],
        key=["H", "D"])(_index_kernel)
