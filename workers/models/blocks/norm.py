"""RMSNorm, the one normalisation every family here uses (layer norms, final norm, Qwen3's q/k norms).

Computed in float32 whatever the compute dtype, then scaled by the weight in the input dtype, as
the transformers reference models do: the same rounding is what makes bf16 runs comparable.
:class:`GemmaRMSNorm` is Gemma's variant: the weight is stored as an offset from 1 (``x * (1 +
w)``, so 0 is the identity and checkpoints hold the offset) and the product is taken in float32
before the cast (transformers' Gemma3RMSNorm), which rounds differently in bf16.
"""
from __future__ import annotations

import torch
from torch import nn


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dim, computed in float32, returned in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scaled(x, self.weight)

    def scaled(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The norm of ``x`` with ``weight`` for this module's own (a tensor-parallel wrapper passes the
        weight through a gradient all-reduce: workers/trainer/parallel/tensor.py HeadSharedNorm)."""
        return weight * rms_normalize(x, self.eps)


class GemmaRMSNorm(nn.Module):
    """``rms_normalize(x) * (1 + weight)`` in float32, cast to x's dtype; weight 0 is the identity
    (Gemma 3's layer, final and q/k norms; the step-0 init is zeros, as transformers initialises it)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scaled(x, self.weight)

    def scaled(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """As :meth:`RMSNorm.scaled`, with Gemma's ``(1 + weight)`` in float32."""
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + weight.float())).to(x.dtype)
