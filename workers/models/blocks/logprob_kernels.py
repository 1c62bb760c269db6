"""Triton row kernels of the fused log-prob head (workers/models/blocks/fused_logprobs.py) on CUDA.

Why: around its GEMMs the fused head's torch path makes about eight float32 passes over each
``chunk x V`` block in the forward (upcast, / T, max, gather, subtract, exp, product, sums) and as many
in the backward, each 4 bytes a logit: at 8,192 positions and a 152k vocabulary ~5 GB a pass,
about as long as the GEMMs themselves on an H200. These kernels read the compute-dtype logits once:

* :func:`row_stats` (forward): per row an online max / sum-exp / sum p z over V in tiles (one
  running max per row, so one exp a logit), then ``lse``, ``log p(y) = z_y - lse`` and the entropy
  ``lse - sum p z``, all in float32 (z = logit / T, computed as the torch path does: upcast, then
  divide; no division at T = 1);
* :func:`row_grad_` (backward): ``G = g (onehot(y) - exp(z - lse))`` written over the logits in
  place, in their dtype (the GEMMs' input): no float32 block at all.

tests/unit/models/test_fused_logprobs.py runs both under Triton's CPU interpreter against the torch path.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs without triton
    triton = None

BLOCK_V = 2048
ROUND_BLOCK = 4096


def usable(logits: torch.Tensor) -> bool:
    """The kernels apply: Triton present and CUDA logits (or the interpreter, ``TRITON_INTERPRET=1``)."""
    return triton is not None and (logits.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def row_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log p(target), entropy, lse)`` float32 ``[n]`` of ``logits [n, V]`` / ``temperature``."""
    n, v = logits.shape
    logp, entropy, lse = (torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(3))
    _stats_kernel[(n,)](logits, targets, logp, entropy, lse, v, logits.stride(0), float(temperature),
                        BLOCK_V=BLOCK_V, UNIT_T=float(temperature) == 1.0)
    return logp, entropy, lse


def row_grad_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
              temperature: float) -> torch.Tensor:
    """``logits`` [n, V] overwritten by ``g * (onehot(target) - softmax(logits / T))`` (``g`` float32 [n]
    already divided by T); returns ``logits``."""
    n, v = logits.shape
    _grad_kernel[(n,)](logits, targets, lse, g, v, logits.stride(0), float(temperature), BLOCK_V=BLOCK_V,
                       UNIT_T=float(temperature) == 1.0)
    return logits


def round_scaled(src: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(src * scale)`` in float32, stored as ``dtype``, in one pass (``src`` contiguous; ``scale`` a
    one-element float32 tensor on its device: read there, never on the host). The fused-loss head's
    backward hands the float32 weight gradient back this way: a rounding copy followed by an in-place
    multiply by a device scalar was two passes, the second one torch's slow broadcast path."""
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    n = src.numel()
    _round_scale_kernel[(triton.cdiv(n, ROUND_BLOCK),)](src, out, scale.reshape(1), n, BLOCK=ROUND_BLOCK)
    return out


if triton is not None:
    @triton.jit
    def _stats_kernel(z_ptr, y_ptr, logp_ptr, ent_ptr, lse_ptr, V, stride, temperature, BLOCK_V: tl.constexpr,
                      UNIT_T: tl.constexpr):
        # one running max per row (a scalar), so each logit costs one exp: the tile's max is taken
        # first and the running sums are rescaled once a tile, not once a lane
        row = tl.program_id(0)
        base = z_ptr + row.to(tl.int64) * stride
        m = tl.full([], float("-inf"), tl.float32)  # running max
        s = tl.full([], 0.0, tl.float32)  # sum exp(z - m)
        t = tl.full([], 0.0, tl.float32)  # sum exp(z - m) (z - m), as the torch path's sums
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            if not UNIT_T:
                z = z / temperature
            m_new = tl.maximum(m, tl.max(z, 0))
            ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: sums stay 0
            keep = tl.where(m == float("-inf"), 0.0, tl.exp(m - ref))
            shift = tl.where(m == float("-inf"), 0.0, m - ref)
            e = tl.exp(z - ref)  # 0 where z is -inf (masked lanes)
            zc = tl.where(z == float("-inf"), 0.0, z - ref)
            t = keep * (t + s * shift) + tl.sum(e * zc, 0)
            s = s * keep + tl.sum(e, 0)
            m = m_new
        log_s = tl.log(s)
        lse = m + log_s
        y = tl.load(y_ptr + row)
        z_y = tl.load(base + y).to(tl.float32)
        if not UNIT_T:
            z_y = z_y / temperature
        tl.store(lse_ptr + row, lse)
        tl.store(logp_ptr + row, z_y - lse)
        tl.store(ent_ptr + row, log_s - t / s)

    @triton.jit
    def _grad_kernel(z_ptr, y_ptr, lse_ptr, g_ptr, V, stride, temperature, BLOCK_V: tl.constexpr,
                     UNIT_T: tl.constexpr):
        row = tl.program_id(0)
        base = z_ptr + row.to(tl.int64) * stride
        lse = tl.load(lse_ptr + row)
        g = tl.load(g_ptr + row)
        y = tl.load(y_ptr + row)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            inside = cols < V
            z = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
            if not UNIT_T:
                z = z / temperature
            grad = tl.where(cols == y, g, 0.0) - g * tl.exp(z - lse)
            tl.store(base + cols, grad.to(z_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _round_scale_kernel(src_ptr, dst_ptr, scale_ptr, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < N
        x = tl.load(src_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        tl.store(dst_ptr + offs, (x * tl.load(scale_ptr)).to(dst_ptr.dtype.element_ty), mask=inside)
