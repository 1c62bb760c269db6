"""The pre-norm decoder layer of the attention + MLP families (Llama, Qwen3, Qwen2, Mistral, Qwen3-MoE, tiny_moe).

``x + attn(norm(x))`` then ``x + mlp(norm(x))``, HF module names (``input_layernorm``,
``self_attn``, ``post_attention_layernorm``, ``mlp``). The MLP is either a dense SwiGLU or a
routed MoE block; a layer with a routed MLP sets ``routed = True`` (the skeleton's Router Replay
indexing, workers/models/blocks/decoder.py) and returns its :class:`Routing`. The trainer swaps
``self_attn`` and ``mlp`` for their tensor/expert-parallel versions in place, so ``routed`` is
decided once here, from the module the layer was built with.
"""
from __future__ import annotations

import torch
from torch import nn

from workers.models.blocks.decode_fused import attention_step, covers, decoding, layer_step
from workers.models.blocks.decoder import ForwardContext, Routing
from workers.models.blocks.moe_softmax import MoeBlock
from workers.models.blocks.norm import RMSNorm


class DecoderLayer(nn.Module):
    """Pre-norm attention + (MoE or dense) MLP: ``forward(x, ctx) -> (x, Routing | None)``."""

    def __init__(self, *, hidden_size: int, rms_norm_eps: float, attention: nn.Module, mlp: nn.Module):
        super().__init__()
        self.routed = isinstance(mlp, MoeBlock)
        self.input_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, ctx: ForwardContext):
        if decoding(ctx) and covers(self):  # the static engine's decode step: fused kernels
            if not self.routed:
                return layer_step(self, x, ctx), None
            x, h = attention_step(self, x, ctx)
            if type(self.mlp).forward is MoeBlock.forward and ctx.forced is None:  # no balance terms
                y, idx = self.mlp.decode(h)
                aux, load = ctx.shared(("no_balance", self.mlp.num_experts), lambda: (
                    torch.zeros((), device=x.device), torch.zeros(self.mlp.num_experts, device=x.device)))
                return x + y, Routing(experts=idx, aux_loss=aux, load=load)
        else:
            x = x + self.self_attn(self.input_layernorm(x), ctx)
            h = self.post_attention_layernorm(x)
        if not self.routed:
            return x + self.mlp(h), None
        y, idx, aux, load = self.mlp(h, ctx.forced, ctx.valid, ctx.forced_mask)
        return x + y, Routing(experts=idx, aux_loss=aux, load=load)
