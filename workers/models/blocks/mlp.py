"""The SwiGLU MLP: a dense layer's MLP and each routed expert (HF names gate_proj / up_proj / down_proj)."""
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
