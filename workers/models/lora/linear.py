"""LoRA on an ``nn.Linear``: the module keeps its class's forward and its ``weight`` (frozen), and
gains ``lora_A`` [r, in] and ``lora_B`` [out, r] (trainable, float32 master):

    y = base(x) + (alpha / r) * dropout(x) @ A^T @ B^T

Why a class swap instead of a wrapper module: the module tree and every parameter name of the base
stay as they were (``...q_proj.weight``, the HF name), so the sharding plans, the checkpoint loaders
and the step-0 publish keep working unchanged; the adapters sit beside the weight as
``...q_proj.lora_A`` / ``...q_proj.lora_B`` (the PEFT file names are made at publish time:
workers/weights/lora_format.py). Two skinny matmuls instead of merging ``B @ A`` into the weight:
the [out, in] delta is never formed in the forward or the backward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LoraLinear(nn.Linear):
    """An ``nn.Linear`` turned into a LoRA target by :func:`lora_linear` (module docstring)."""

    lora_scale: float
    lora_dropout: float
    lora_rows = None
    """Several adapters (rows.py): the shared per-token adapter choice; None with one adapter."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        a, b = self.lora_A, self.lora_B
        inp = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        xa = F.linear(inp, a.to(x.dtype))
        if self.lora_rows is not None:  # N adapters side by side: each token keeps its own block
            xa = xa * self.lora_rows.mask(xa)
        return y + F.linear(xa, b.to(x.dtype)) * self.lora_scale


def lora_linear(mod: nn.Linear, *, rank: int, scale: float, dropout: float, dtype: torch.dtype,
                rows=None) -> LoraLinear:
    """Turn ``mod`` into a :class:`LoraLinear` in place (same object): ``lora_A``/``lora_B`` of ``dtype`` on
    its weight's device (meta stays meta; values come from :func:`workers.models.lora.inject.init_tensors`).
    ``rows`` (several adapters, rows.py): the factors are ``rows.num_adapters`` adapters side by side."""
    out_f, in_f = mod.weight.shape
    if rows is not None:
        rank = rank * rows.num_adapters
        mod.lora_rows = rows
    dev = mod.weight.device
    mod.__class__ = LoraLinear
    mod.lora_A = nn.Parameter(torch.zeros(rank, in_f, dtype=dtype, device=dev))
    mod.lora_B = nn.Parameter(torch.zeros(out_f, rank, dtype=dtype, device=dev))
    mod.lora_scale, mod.lora_dropout = float(scale), float(dropout)
    return mod
