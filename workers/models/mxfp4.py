"""MXFP4 weights (GPT-OSS checkpoints, ``quantization_config.quant_method: mxfp4``), dequantised on load.

OpenAI's GPT-OSS releases store the routed experts' matrices in the OCP microscaling FP4 format
(the rest is bf16). A tensor ``X`` of logical shape ``[E, in, out]`` (transformers' in-memory
layout, ``x @ X[e]``) is stored as two tensors:

    X_blocks  uint8 [E, out, in / 32, 16]  two FP4 (E2M1) codes per byte, low nibble first,
                                           32 consecutive input elements per block
    X_scales  uint8 [E, out, in / 32]      one E8M0 scale per block: 2 ** (s - 127)

An E2M1 code is a sign bit and one of ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` (:data:`FP4_VALUES`, the
OCP MX spec's table). Dequantising gives ``[E, out, in]``, transposed to the logical layout; every
value is a code times a power of two, so bf16 holds it exactly. The published steps are bf16
with no ``quantization_config`` (workers/weights/filesystem/hf_layout.py writes the family's
``to_hf_config``, which never has one): inference loads them as any bf16 checkpoint.

:func:`pack` is the inverse (values exactly representable: a code times the block's scale) for
tests that build a tiny MXFP4 checkpoint.
"""
from __future__ import annotations

from typing import Optional

import torch

BLOCKS, SCALES = "_blocks", "_scales"
BLOCK = 32
"""Input elements per scale."""
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""E2M1 code -> value (bit 3 the sign)."""
BIAS = 127
"""E8M0 exponent bias: a stored scale byte ``s`` means ``2 ** (s - 127)``."""


def logical_shape(blocks_shape: list[int]) -> list[int]:
    """``[E, out, G, 16]`` blocks -> the dequantised ``[E, G * 32, out]``."""
    *lead, out, groups, half = blocks_shape
    return [*lead, groups * half * 2, out]


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``[E, out, G, 16]`` uint8 codes and ``[E, out, G]`` uint8 scales -> ``[E, G * 32, out]`` in ``dtype``."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match "
                         f"(scales must be the blocks' shape without the last dim)")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = blocks.to(torch.uint8)
    lo, hi = lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]
    values = torch.stack([lo, hi], dim=-1).flatten(-2)  # [..., G, 32]: low nibble first
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - BIAS)
    return values.flatten(-2).transpose(-1, -2).contiguous().to(dtype)


def pack(w: torch.Tensor, scale_exponents: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of ``w`` ``[E, in, out]`` whose every 32-element input block is an FP4 code times
    ``2 ** scale_exponents`` ``[E, out, in / 32]`` (0 when None). ValueError if a value is not one."""
    e, n_in, n_out = w.shape
    if n_in % BLOCK:
        raise ValueError(f"MXFP4 needs the input dim ({n_in}) in blocks of {BLOCK}")
    rows = w.transpose(1, 2).float().reshape(e, n_out, n_in // BLOCK, BLOCK)
    exps = torch.zeros(e, n_out, n_in // BLOCK, dtype=torch.int32) if scale_exponents is None else scale_exponents
    unit = torch.ldexp(rows, -exps.to(torch.int32)[..., None])
    lut = torch.tensor(FP4_VALUES)
    codes = (unit[..., None] == lut).float().argmax(-1)
    codes = torch.where(torch.signbit(unit) & (unit == 0), 8, codes)  # -0.0 keeps its sign code
    if not torch.equal(lut[codes], unit):
        raise ValueError("pack: some value is not an FP4 code times its block's scale")
    codes = codes.to(torch.uint8).view(e, n_out, n_in // BLOCK, BLOCK // 2, 2)
    blocks = (codes[..., 0] | (codes[..., 1] << 4)).contiguous()
    return blocks, (exps + BIAS).to(torch.uint8)
