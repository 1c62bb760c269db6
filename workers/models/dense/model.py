"""The dense decoder of families qwen3, qwen2 and mistral in plain torch, from the shared blocks.

Every layer (workers/models/blocks/layer.py) is GQA attention with the family's switches (q/k norms,
biases, the layer's sliding window: workers/models/blocks/attention.py) and a SwiGLU MLP. Parameter
names are the checkpoints' (``model.layers.N.self_attn.q_proj.bias``, ``...q_norm.weight``), so a
transformers checkpoint loads with ``load_state_dict(strict=True)`` and ``state_dict()`` is one.
"""
from __future__ import annotations

import torch
from torch import nn

from workers.models.blocks.attention import Attention
from workers.models.blocks.decoder import Backbone, CausalLM
from workers.models.blocks.layer import DecoderLayer
from workers.models.blocks.mlp import SwiGLU
from workers.models.blocks.norm import RMSNorm
from workers.models.dense.config import DenseConfig


def dense_layer(cfg: DenseConfig, i: int) -> DecoderLayer:
    h = cfg.hidden_size
    attn = Attention(hidden_size=h, num_heads=cfg.num_heads, num_kv_heads=cfg.kv_heads,
                     head_dim=cfg.attention_head_dim, rope_theta=cfg.rope_theta,
                     qk_norm_eps=cfg.rms_norm_eps if cfg.qk_norm else None, qkv_bias=cfg.qkv_bias,
                     o_bias=cfg.o_bias, sliding_window=cfg.layer_window(i))
    return DecoderLayer(hidden_size=h, rms_norm_eps=cfg.rms_norm_eps, attention=attn,
                        mlp=SwiGLU(h, cfg.dense_intermediate_size))


class DenseForCausalLM(CausalLM):
    def __init__(self, cfg: DenseConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(nn.Embedding(cfg.vocab_size, cfg.hidden_size),
                              [dense_layer(cfg, i) for i in range(cfg.num_layers)], RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))
        self.make_head()


def build(cfg: DenseConfig, *, device=None, dtype=None) -> DenseForCausalLM:
    return DenseForCausalLM.create(cfg, device=device, dtype=dtype)


def init(cfg: DenseConfig, dtype=torch.float32) -> DenseForCausalLM:
    return DenseForCausalLM.step0(cfg, dtype)
