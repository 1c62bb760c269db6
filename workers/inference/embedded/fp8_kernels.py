"""CUDA side of the fp8 engine: activation quantization in one Triton kernel, then torch's fp8 GEMMs.

Why a kernel of our own for the activations: quantizing a token row with torch ops is eight kernels
(cast, abs, amax, clamp, divide, divide, clamp, cast); a decode step runs ~7 projections per layer,
so at small batch sizes those launches would cost more than the fp8 GEMM saves. One Triton program
per (row, group) reads the row once and writes the fp8 values and the scale.

GEMMs: ``torch._scaled_mm`` (rowwise scales, or 1x128 activation groups by 128x128 weight blocks) and
``torch._scaled_grouped_mm`` (rowwise: one scale per token and one per expert output channel) for the
routed experts. Both are CUDA-graph capturable (no host sync). The reference math is
workers/inference/embedded/fp8.py's ``reference_linear``.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch ops below stand in
    triton = None

FP8_MAX = 448.0
MAX_TRITON_WIDTH = 16384  # one program holds a group in registers


if triton is not None:
    @triton.jit(do_not_specialize=["x_row_stride", "num_rows"])  # one compile per width, whatever the batch
    def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, x_row_stride, num_rows, width, GROUP: tl.constexpr,
                                BLOCK: tl.constexpr, TRANSPOSED_SCALES: tl.constexpr):
        """Program (row, g): fp8 of x[row, g*GROUP:(g+1)*GROUP] over its amax / 448; the scale goes to
        s[row, g] (or s[g, row] with TRANSPOSED_SCALES: the outer-dim-major layout blockwise GEMMs read)."""
        row = tl.program_id(0)
        g = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        col = g * GROUP + offs
        mask = (offs < GROUP) & (col < width)
        x = tl.load(x_ptr + row * x_row_stride + col, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), 0), 1e-12) / 448.0
        q = tl.clamp(x / scale, -448.0, 448.0)
        tl.store(q_ptr + row * width + col, q.to(q_ptr.dtype.element_ty), mask=mask)
        if TRANSPOSED_SCALES:
            tl.store(s_ptr + g * num_rows + row, scale)
        else:
            tl.store(s_ptr + row * tl.num_programs(1) + g, scale)


def quantize_activation(x: torch.Tensor, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x [M, K]`` -> (fp8 ``[M, K]``, scales): ``group`` 0: one per row ``[M]``; else 1x``group``
    groups, ``[M, K/group]`` outer-dim-major (stride (1, M)), what blockwise ``_scaled_mm`` reads."""
    m, k = x.shape
    width = group or k
    if triton is None or not x.is_cuda or width > MAX_TRITON_WIDTH or x.stride(-1) != 1:
        from workers.inference.embedded.fp8_quant import quantize_groups, quantize_rows

        if not group:
            return quantize_rows(x)
        q, s = quantize_groups(x, group)
        return q, s.t().contiguous().t()
    groups = k // width
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((groups, m) if group else (m,), dtype=torch.float32, device=x.device)
    if m:
        _quantize_groups_kernel[(m, groups)](x, q, s, x.stride(0), m, k, GROUP=width,
                                             BLOCK=triton.next_power_of_2(width), TRANSPOSED_SCALES=bool(group))
    return q, (s.t() if group else s)


def scaled_linear(rows: torch.Tensor, qweight: torch.Tensor, qscale: torch.Tensor, scheme: str) -> torch.Tensor:
    """``rows [M, K]`` (bf16) times the fp8 weight ``[N, K]``: ``[M, N]`` in ``rows``' dtype."""
    if scheme == "block":
        # torch's v1 ``_scaled_mm`` picks (BlockWise1x128, BlockWise128x128) from the layouts alone: the
        # activation scales [M, K/128] outer-dim-major (stride (1, M)), the weight's [N/128, K/128] row-major
        # passed transposed; its row stride K/128 must be a multiple of 4 in some torch versions and exactly
        # K/128 in others, so the block scheme takes K in multiples of 512 only (fp8_quant.fits_block)
        xq, xs = quantize_activation(rows, 128)
        return torch._scaled_mm(xq, qweight.t(), scale_a=xs, scale_b=qscale.t(), out_dtype=rows.dtype)
    xq, xs = quantize_activation(rows)
    return torch._scaled_mm(xq, qweight.t(), scale_a=xs[:, None], scale_b=qscale[None, :], out_dtype=rows.dtype)


def scaled_grouped(rows: torch.Tensor, qstack: torch.Tensor, qscale: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Every expert's fp8 projection on its rows (grouped by expert, group ends ``offs``): ``rows [M, K]``,
    ``qstack [E, N, K]``, ``qscale [E, N]`` -> ``[M, N]``; ONE grouped GEMM."""
    xq, xs = quantize_activation(rows)
    return torch._scaled_grouped_mm(xq, qstack.transpose(1, 2), xs, qscale, offs=offs, out_dtype=rows.dtype)


def grouped_available() -> bool:
    return hasattr(torch, "_scaled_grouped_mm")


def fp8_matmul(rows: torch.Tensor, qweight: torch.Tensor, qscale: torch.Tensor, scheme: str) -> torch.Tensor:
    """``rows [M, K]`` times an fp8 weight: the CUDA kernels, or on CPU their float32 reference."""
    if rows.is_cuda:
        return scaled_linear(rows, qweight, qscale, scheme)
    from workers.inference.embedded.fp8_quant import reference_linear

    return reference_linear(rows, qweight, qscale, scheme).to(rows.dtype)
