"""The "sandwich" decoder layer of Gemma 2/3: every sublayer normed on its way in AND on its way out.

``x + post_attention_layernorm(attn(input_layernorm(x)))`` then
``x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))``, HF module names. Unlike the
pre-norm layer (blocks/layer.py), ``post_attention_layernorm`` normalises the attention's OUTPUT
before the residual add, and the MLP has a norm of its own on each side. The norm class is the
family's (Gemma: blocks/norm.py GemmaRMSNorm, ``x * (1 + w)``). Dense MLP only (no router).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class SandwichDecoderLayer(nn.Module):
    """``forward(x, ctx) -> (x, None)`` (the decoder skeleton's layer contract, workers/models/blocks/decoder.py)."""

    routed = False

    def __init__(self, *, attention: nn.Module, mlp: nn.Module, norm: Callable[[], nn.Module]):
        super().__init__()
        self.input_layernorm = norm()
        self.self_attn = attention
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = mlp
        self.post_feedforward_layernorm = norm()

    def forward(self, x: torch.Tensor, ctx):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), ctx))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), None
