"""sum64: a per-tensor digest that a patch alone can update (trainer and receivers agree without re-reading).

``sum64(t) = sum_i bits(t[i]) * w(i)  mod 2**64`` over the tensor's flat positions ``i``, where
``bits`` is the element's bit pattern read as a signed integer (int16 for bf16) and ``w(i)`` an odd
64-bit multiplier mixed from ``i``. Why this and not xxh3: it is additive, so
  - a sharded tensor's digest is the sum of its shards' sums (no gather),
  - applying a patch changes it by ``sum (new_bits - old_bits) * w(i)`` over the changed positions
    only (O(changed), on the device, on both sides),
  - the order of summation does not matter (integer addition mod 2**64 is exact), so CPU and GPU,
    one rank or many, give the same value.
Any single changed element changes it (w(i) is odd and |new_bits - old_bits| < 2**32); it is an
integrity check against bugs, truncation and misapplied patches, not against an adversary.
int64 arithmetic in torch wraps on overflow (two's complement) on CPU and CUDA alike.
"""
from __future__ import annotations

import torch

MASK = (1 << 64) - 1
_A = 0x9E3779B97F4A7C15 - (1 << 64)  # golden-ratio constant, as a signed int64
_B = 0x2545F4914F6CDD1D
CHUNK = 1 << 24
"""Elements per chunk of a full-tensor sum (bounds the int64 temporaries to ~400 MB)."""
_INT_OF = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def weights_at(idx: torch.Tensor) -> torch.Tensor:
    """w(i) for int64 positions ``idx`` (same device)."""
    x = idx * _A
    x = x ^ (x >> 29)
    x = x * _B
    return x | 1


def bits(t: torch.Tensor) -> torch.Tensor:
    """The elements' bit patterns as int64 (sign-extended from the element's own width)."""
    return t.reshape(-1).view(_INT_OF[t.element_size()]).to(torch.int64)


def tensor_sum64(t: torch.Tensor, positions: torch.Tensor | None = None) -> int:
    """sum64 of ``t`` (flat positions 0..n-1), or of its values at ``positions`` when given
    (``t`` then holds exactly those values, in that order). Returns an unsigned int."""
    flat = t.detach().reshape(-1)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for lo in range(0, flat.numel(), CHUNK):
        hi = min(lo + CHUNK, flat.numel())
        idx = (positions[lo:hi] if positions is not None
               else torch.arange(lo, hi, dtype=torch.int64, device=flat.device))
        total += (bits(flat[lo:hi]) * weights_at(idx.to(torch.int64))).sum()
    return int(total) & MASK


def delta_sum64(old: torch.Tensor, new: torch.Tensor, positions: torch.Tensor) -> int:
    """How sum64 changes when the values at ``positions`` go from ``old`` to ``new``."""
    if positions.numel() == 0:
        return 0
    d = (bits(new) - bits(old)) * weights_at(positions.to(torch.int64))
    return int(d.sum()) & MASK


def segment_sums_device(values_bits: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor,
                        num_segments: int) -> torch.Tensor:
    """Per segment, ``sum bits * w(position)`` as a wrapping int64 tensor on the values' device (no host
    read: a caller summing many tensors reads them all at once)."""
    contrib = values_bits * weights_at(positions.to(torch.int64))
    out = torch.zeros(num_segments, dtype=torch.int64, device=contrib.device)
    out.index_add_(0, segments, contrib)
    return out


def segment_sums(values_bits: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor,
                 num_segments: int) -> list[int]:
    """Per segment, ``sum bits * w(position)`` mod 2**64 (``segments``: the segment id of each element;
    positions are within each segment's own tensor). One device sync for all segments."""
    return [v & MASK for v in segment_sums_device(values_bits, positions, segments, num_segments).tolist()]


def hex64(v: int) -> str:
    return f"{v & MASK:016x}"


def add64(*vs: int) -> int:
    return sum(vs) & MASK
