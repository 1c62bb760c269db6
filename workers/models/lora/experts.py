"""LoRA on routed-expert stacks ([E, out, in] parameters, workers/models/blocks/experts.py) through the
experts' own grouped GEMMs: no per-expert Python loop on the fast path.

Adapters per stack (``gate_up_proj`` or ``up_proj``, and ``down_proj``), in ``lora_A`` / ``lora_B``
(ParameterDicts keyed by stack name, so names read ``...experts.lora_A.gate_up_proj``):

``per_expert``    A [E, r, in], B [E, out, r]: expert e's update is ``s * B_e @ A_e`` (peft's
                  ``target_parameters`` layout, and what prime-rl trains).
``shared_outer``  the factor on the hidden-size side is shared by every expert, the expert-width side
                  is per expert: gate_up/up has one A [r, hidden] and B [E, out, r]; down has
                  A [E, r, inter] and one B [hidden, r]. Why: the hidden-side factors are the large
                  ones (hidden >> expert width in fine-grained MoEs), so sharing them roughly halves
                  the adapter (and the bytes per update), and the shared A of the input side is one
                  plain matmul per token instead of one per routed slot. Published expanded to the
                  per-expert layout (the shared factor repeated E times), which peft and the engine load.

Grouped path (bf16 on CUDA): per projection ``grouped_mm(x, W^T)`` + ``s * grouped_mm(grouped_mm(x, A^T),
B^T)`` with the same device-side offsets (a shared factor is a plain matmul instead); the rank is
zero-padded to a multiple of 8 for grouped_mm's 16-byte strides (the padding's gradient is dropped).
Loop path (CPU, tests): each expert's ``F.linear`` plus its two skinny matmuls. Dropout is not
applied here (peft's expert LoRA has none).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.blocks.experts import StackedExperts

PER_EXPERT, SHARED_OUTER = "per_expert", "shared_outer"


def _pad_rank(t: torch.Tensor, dim: int) -> torch.Tensor:
    r = t.shape[dim]
    pad = -r % 8
    if not pad:
        return t
    spec = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, pad]
    return F.pad(t, spec)


class LoraExperts(StackedExperts):
    """StackedExperts with LoRA adapters on every stack (module docstring); made by :func:`lora_experts`."""

    lora_scale: float
    lora_mode: str

    def shared_side(self, stack: str) -> str:
        """Which factor of ``stack`` is shared under shared_outer: ``A`` (input side) or ``B`` (output side)."""
        return "B" if stack == "down_proj" else "A"

    def _factors(self, stack: str):
        return self.lora_A[stack], self.lora_B[stack]

    def linear(self, stack: str, e: int, x: torch.Tensor) -> torch.Tensor:
        a, b = self._factors(stack)
        a_e = a if a.dim() == 2 else a[e]
        b_e = b if b.dim() == 2 else b[e]
        return super().linear(stack, e, x) + F.linear(F.linear(x, a_e.to(x.dtype)), b_e.to(x.dtype)) * self.lora_scale

    def project(self, stack: str, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        a, b = self._factors(stack)
        a, b = a.to(x.dtype), b.to(x.dtype)
        if a.dim() == 2:  # shared input side: one matmul for every row
            t = F.linear(x, a)
        else:
            t = F.grouped_mm(x, _pad_rank(a, 1).transpose(1, 2), offs=offs)
        if b.dim() == 2:  # shared output side
            t = t[:, :b.shape[1]] if a.dim() == 3 else t
            lora = F.linear(t, b)
        else:
            t = _pad_rank(t, 1) if a.dim() == 2 else t
            lora = F.grouped_mm(t, _pad_rank(b, 2).transpose(1, 2), offs=offs)
        return super().project(stack, x, offs) + lora * self.lora_scale

    @torch.no_grad()
    def narrow_(self, first: int, count: int) -> None:
        raise NotImplementedError("LoRA experts under expert parallelism (trainer.parallel.ep > 1) are not "
                                  "supported; the plan refuses trainer.lora.rank > 0 with ep > 1")

    def per_expert_factors(self, stack: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full ``(A [E, r, in], B [E, out, r])`` of ``stack`` from full factors ``a``, ``b`` (a shared
        one repeated over the experts: the published per-expert layout)."""
        e = self.num_local
        if a.dim() == 2:
            a = a.unsqueeze(0).expand(e, *a.shape)
        if b.dim() == 2:
            b = b.unsqueeze(0).expand(e, *b.shape)
        return a, b


def factor_shapes(mod: StackedExperts, stack: str, rank: int, mode: str) -> tuple[tuple, tuple]:
    """Shapes of ``(A, B)`` for ``stack`` of ``mod`` under ``mode``."""
    e, out_f, in_f = getattr(mod, stack).shape
    a = (rank, in_f) if mode == SHARED_OUTER and stack != "down_proj" else (e, rank, in_f)
    b = (out_f, rank) if mode == SHARED_OUTER and stack == "down_proj" else (e, out_f, rank)
    return a, b


def lora_experts(mod: StackedExperts, *, rank: int, scale: float, mode: str, dtype: torch.dtype) -> LoraExperts:
    """Turn ``mod`` into a :class:`LoraExperts` in place (zeros; values from inject.init_tensors)."""
    if mode not in (PER_EXPERT, SHARED_OUTER):
        raise ValueError(f"trainer.lora.experts={mode!r}: choose one of {[PER_EXPERT, SHARED_OUTER]}")
    dev = mod.down_proj.device
    shapes = {s: factor_shapes(mod, s, rank, mode) for s in mod.stacks()}
    mod.__class__ = LoraExperts
    mod.lora_A = nn.ParameterDict({s: nn.Parameter(torch.zeros(a, dtype=dtype, device=dev)) for s, (a, _) in shapes.items()})
    mod.lora_B = nn.ParameterDict({s: nn.Parameter(torch.zeros(b, dtype=dtype, device=dev)) for s, (_, b) in shapes.items()})
    mod.lora_scale, mod.lora_mode = float(scale), mode
    return mod
