"""Qwen3-MoE in plain torch from the shared blocks: the module the trainer and the embedded engine run.

Per layer (workers/models/blocks/layer.py): GQA attention with per-head q/k RMSNorm before
rotary and ``head_dim`` free (blocks/attention.py), then either the softmax top-k MoE with
``norm_topk_prob`` (blocks/moe_softmax.py) or, in the layers ``Qwen3MoeConfig.is_moe_layer``
rules out, a dense SwiGLU of ``dense_intermediate_size``. Parameter names are the checkpoint's
(``model.layers.N.self_attn.q_norm.weight``, ``model.layers.N.mlp.gate.weight``,
``model.layers.N.mlp.experts.E.down_proj.weight``), so a Qwen3-MoE checkpoint loads with
``load_state_dict(strict=True)`` and ``state_dict()`` is a checkpoint transformers loads.
Routed-expert records and Router Replay index the routed layers only (``num_routed_layers``).
"""
from __future__ import annotations

import torch
from torch import nn

from workers.models.blocks.attention import Attention
from workers.models.blocks.decoder import Backbone, CausalLM
from workers.models.blocks.layer import DecoderLayer
from workers.models.blocks.mlp import SwiGLU
from workers.models.blocks.moe_softmax import MoeBlock
from workers.models.blocks.norm import RMSNorm
from workers.models.qwen3_moe.config import Qwen3MoeConfig


def qwen3_layer(cfg: Qwen3MoeConfig, i: int) -> DecoderLayer:
    h = cfg.hidden_size
    attn = Attention(hidden_size=h, num_heads=cfg.num_heads, num_kv_heads=cfg.kv_heads,
                     head_dim=cfg.attention_head_dim, rope_theta=cfg.rope_theta, qk_norm_eps=cfg.rms_norm_eps)
    if cfg.is_moe_layer(i):
        mlp = MoeBlock(hidden_size=h, num_experts=cfg.num_experts, top_k=cfg.top_k,
                       expert_intermediate_size=cfg.expert_intermediate_size, norm_topk_prob=cfg.norm_topk_prob)
    else:
        mlp = SwiGLU(h, cfg.dense_intermediate_size)
    return DecoderLayer(hidden_size=h, rms_norm_eps=cfg.rms_norm_eps, attention=attn, mlp=mlp)


class Qwen3MoeForCausalLM(CausalLM):
    def __init__(self, cfg: Qwen3MoeConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(nn.Embedding(cfg.vocab_size, cfg.hidden_size),
                              [qwen3_layer(cfg, i) for i in range(cfg.num_layers)], RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))
        self.make_head()


def build(cfg: Qwen3MoeConfig, *, device=None, dtype=None) -> Qwen3MoeForCausalLM:
    return Qwen3MoeForCausalLM.create(cfg, device=device, dtype=dtype)


def init(cfg: Qwen3MoeConfig, dtype=torch.float32) -> Qwen3MoeForCausalLM:
    return Qwen3MoeForCausalLM.step0(cfg, dtype)
