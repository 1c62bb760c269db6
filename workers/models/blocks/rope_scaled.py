"""Rotary position embedding with the scalings real checkpoints ship: plain RoPE, linear and YaRN.

DeepSeek-V3, Kimi-K2 and GLM-5 rotate only a slice of each query/key head (``qk_rope_head_dim``)
and extend their context with YaRN: the inverse frequencies blend interpolated (divided by
``factor``) and original ones over a ramp between the ``beta_fast`` / ``beta_slow`` correction
dimensions, and cos/sin are multiplied by an attention factor (``mscale`` over ``mscale_all_dim``).
MLA additionally multiplies its softmax scale by ``mscale(factor, mscale_all_dim)**2``
(:meth:`Rope.softmax_scale`). The formulas follow the YaRN paper as transformers 5.x applies them
(``_compute_yarn_parameters``), so logits agree to float rounding. ``truncate`` (on by default, as
there) rounds the correction range to whole dimensions; GPT-OSS turns it off. Linear scaling
(Gemma 3's global layers in the 4B-27B checkpoints) divides every frequency by ``factor``.

Two layouts of the rotated slice: half-split (``rotate_half``: pairs ``(i, i + d/2)``) and
interleaved (pairs ``(2i, 2i + 1)``, DeepSeek's original weights). The interleaved form returns
the rotated pairs de-interleaved (evens then odds), as transformers does; queries and keys get the
same permutation, so dot products are unchanged, and caches hold keys in this output layout.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from workers.models.blocks.attention import apply_rope


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rope:
    """One model's rotary embedding: ``dim`` rotated channels, base ``theta``, optional YaRN.

    ``scaling`` ``"default"`` ignores the other fields, ``"linear"`` reads ``factor`` only.
    ``mscale`` / ``mscale_all_dim`` 0 mean absent (config.json leaves them out), as in transformers.
    """

    dim: int
    theta: float
    scaling: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True

    def inv_freq(self, device=None) -> torch.Tensor:
        """[dim/2] float32 inverse frequencies (YaRN-blended when scaled)."""
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim
        pos_freqs = self.theta ** exponents
        if self.scaling == "default":
            return 1.0 / pos_freqs
        if self.scaling == "linear":
            return 1.0 / pos_freqs / self.factor
        low, high = self._correction_range()
        if low == high:
            high += 0.001  # a degenerate ramp would divide by zero
        ramp = ((torch.arange(self.dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
        keep_original = 1 - ramp  # 1: high-frequency dims keep their frequency (extrapolate)
        return (1.0 / (self.factor * pos_freqs)) * (1 - keep_original) + (1.0 / pos_freqs) * keep_original

    def _correction_range(self) -> tuple[float, float]:
        def dim_of(rotations: float) -> float:
            return (self.dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))
                    / (2 * math.log(self.theta)))

        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, self.dim - 1)

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (YaRN's magnitude correction; 1 unscaled)."""
        if self.scaling != "yarn":
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor, 1.0)

    def softmax_scale(self, qk_head_dim: int) -> float:
        """MLA's softmax scale: ``qk_head_dim**-0.5``, times ``mscale(factor, mscale_all_dim)**2`` under YaRN."""
        scale = qk_head_dim ** -0.5
        if self.scaling == "yarn" and self.mscale_all_dim:
            scale *= yarn_mscale(self.factor, self.mscale_all_dim) ** 2
        return scale

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) ``[B, 1, T, dim]`` for positions ``[B, T]`` (both halves repeat the frequencies)."""
        freqs = positions.float()[..., None] * self.inv_freq(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        f = self.attention_factor
        return (emb.cos() * f).to(dtype)[:, None], (emb.sin() * f).to(dtype)[:, None]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the last dim of ``x`` by (cos, sin) broadcast against it (see the module docstring)."""
    if not interleaved:
        return apply_rope(x, cos, sin)
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * c - odd * s, odd * c + even * s], dim=-1)
