"""The fp8 quantization math of the embedded engine (inference.dtype=float8), torch only.

Scales are float32 dequantization factors (``x ~= q * scale``) over rows, 1x128 groups or 128x128
blocks; :func:`reference_linear` is what the CUDA kernels (fp8_kernels.py) compute, in float32: the CPU
path of the fp8 modules (fp8.py, fp8_experts.py) and the reference of the tests.
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
BLOCK = 128
EPS = 1e-12  # smallest amax: an all-zero row quantizes to zeros, not NaN


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` -> (fp8 ``[..., N, K]``, scale ``[..., N]``): one scale per row (a weight's output
    channel, an activation's token)."""
    wf = w.float()
    scale = wf.abs().amax(-1).clamp_min(EPS) / FP8_MAX
    return (wf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[..., None]


def quantize_blocks(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` (multiples of ``block``) -> (fp8 ``[N, K]``, scale ``[N/block, K/block]``)."""
    n, k = w.shape
    wb = w.float().view(n // block, block, k // block, block)
    scale = wb.abs().amax((1, 3)).clamp_min(EPS) / FP8_MAX
    q = (wb / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(n, k), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    n, k = q.shape
    return (q.float().view(n // block, block, k // block, block) * scale[:, None, :, None]).view(n, k)


def quantize_groups(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Activation rows ``x [M, K]`` in 1x``block`` groups -> (fp8 ``[M, K]``, scale ``[M, K/block]``)."""
    m, k = x.shape
    q, scale = quantize_rows(x.reshape(m, k // block, block))
    return q.view(m, k), scale


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    m, k = q.shape
    return dequantize_rows(q.view(m, k // block, block), scale).view(m, k)


def fits_rowwise(n: int, k: int) -> bool:
    """``_scaled_mm`` wants both widths in multiples of 16 (16-byte fp8 strides)."""
    return n % 16 == 0 and k % 16 == 0


def fits_block(n: int, k: int) -> bool:
    """128x128 weight blocks: N a multiple of 128, K of 512 (K/128 scale columns a multiple of 4, so the
    weight scales' row stride is 16-byte aligned without padding: fp8_kernels.scaled_linear)."""
    return n % BLOCK == 0 and k % (4 * BLOCK) == 0


def reference_linear(rows: torch.Tensor, qweight: torch.Tensor, qscale: torch.Tensor, scheme: str) -> torch.Tensor:
    """What the fp8 kernels compute, in float32: the activations quantized the same way, both dequantized."""
    if scheme == "block":
        xq, xs = quantize_groups(rows)
        w = dequantize_blocks(qweight, qscale)
        return dequantize_groups(xq, xs) @ w.t()
    xq, xs = quantize_rows(rows)
    return dequantize_rows(xq, xs) @ dequantize_rows(qweight, qscale).t()
