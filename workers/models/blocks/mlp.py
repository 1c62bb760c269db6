"""The gated MLPs: SwiGLU (a dense layer's MLP and each routed expert) and Gemma's GELU-tanh variant
(HF names gate_proj / up_proj / down_proj). :class:`GeluTanhGLU` subclasses SwiGLU so the sharding
plans, which split gate/up by columns and down by rows, treat both alike."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, bias-free, as Llama / Qwen3 / DeepSeek MLPs and experts are."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


Expert = SwiGLU
"""A routed expert is a SwiGLU MLP of the expert width (the name the MoE code reads better with)."""


class GeluTanhGLU(SwiGLU):
    """``down(gelu_tanh(gate(x)) * up(x))``: Gemma 3's MLP (``hidden_activation: gelu_pytorch_tanh``)."""

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))
