"""Triton row kernels of the fused log-prob head (workers/models/blocks/fused_logprobs.py) on CUDA.

Why: around its GEMMs the fused head's torch path makes about eight float32 passes over each
``chunk x V`` block in the forward (upcast, / T, max, gather, subtract, exp, product, sums) and as many
in the backward, each 4 bytes a logit: at 8,192 positions and a 152k vocabulary ~5 GB a pass,
about as long as the GEMMs themselves on an H200. These kernels read the compute-dtype logits once:

* :func:`row_stats` (forward): per row an online max / sum-exp / sum p z over V in tiles, then
  ``lse``, ``log p(y) = z_y - lse`` and the entropy ``lse - sum p z``, all in float32
  (z = logit / T, computed as the torch path does: upcast, then divide);
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


def usable(logits: torch.Tensor) -> bool:
    """The kernels apply: Triton present and CUDA logits (or the interpreter, ``TRITON_INTERPRET=1``)."""
    return triton is not None and (logits.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def row_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log p(target), entropy, lse)`` float32 ``[n]`` of ``logits [n, V]`` / ``temperature``."""
    n, v = logits.shape
    logp, entropy, lse = (torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(3))
    _stats_kernel[(n,)](logits, targets, logp, entropy, lse, v, logits.stride(0), float(temperature),
                        BLOCK_V=BLOCK_V)
    return logp, entropy, lse


def row_grad_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
              temperature: float) -> torch.Tensor:
    """``logits`` [n, V] overwritten by ``g * (onehot(target) - softmax(logits / T))`` (``g`` float32 [n]
    already divided by T); returns ``logits``."""
    n, v = logits.shape
    _grad_kernel[(n,)](logits, targets, lse, g, v, logits.stride(0), float(temperature), BLOCK_V=BLOCK_V)
    return logits


if triton is not None:
    @triton.jit
    def _stats_kernel(z_ptr, y_ptr, logp_ptr, ent_ptr, lse_ptr, V, stride, temperature, BLOCK_V: tl.constexpr):
        row = tl.program_id(0)
        base = z_ptr + row.to(tl.int64) * stride
        m = tl.full((BLOCK_V,), float("-inf"), tl.float32)  # per lane: running max
        s = tl.zeros((BLOCK_V,), tl.float32)  # per lane: sum exp(z - m)
        t = tl.zeros((BLOCK_V,), tl.float32)  # per lane: sum exp(z - m) (z - m), as the torch path's sums
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / temperature
            m_new = tl.maximum(m, z)
            keep = tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new))
            shift = tl.where(m == float("-inf"), 0.0, m - m_new)
            e = tl.where(z == float("-inf"), 0.0, tl.exp(z - m_new))
            zc = tl.where(z == float("-inf"), 0.0, z - m_new)
            t = keep * (t + s * shift) + e * zc
            s = s * keep + e
            m = m_new
        mx = tl.max(m, 0)
        scale = tl.where(m == float("-inf"), 0.0, tl.exp(m - mx))
        dm = tl.where(m == float("-inf"), 0.0, m - mx)
        total = tl.sum(s * scale, 0)
        pz = tl.sum(scale * (t + s * dm), 0)
        log_s = tl.log(total)
        lse = mx + log_s
        y = tl.load(y_ptr + row)
        z_y = tl.load(base + y).to(tl.float32) / temperature
        tl.store(lse_ptr + row, lse)
        tl.store(logp_ptr + row, z_y - lse)
        tl.store(ent_ptr + row, log_s - pz / total)

    @triton.jit
    def _grad_kernel(z_ptr, y_ptr, lse_ptr, g_ptr, V, stride, temperature, BLOCK_V: tl.constexpr):
        row = tl.program_id(0)
        base = z_ptr + row.to(tl.int64) * stride
        lse = tl.load(lse_ptr + row)
        g = tl.load(g_ptr + row)
        y = tl.load(y_ptr + row)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            inside = cols < V
            z = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32) / temperature
            grad = tl.where(cols == y, g, 0.0) - g * tl.exp(z - lse)
            tl.store(base + cols, grad.to(z_ptr.dtype.element_ty), mask=inside)
