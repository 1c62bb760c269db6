"""tiny_moe: a small causal Mixture-of-Experts decoder in plain torch (and, with no experts, the
dense Llama of model.family=llama).

Shared by the embedded inference engine and the trainer (through the family specs
workers/models/tiny_moe/spec.py and workers/models/llama/spec.py), so both compute the very
same function (the train/inference mismatch then comes only from dtype and kernel
order, which is what Router Replay and the mismatch metrics are about).

Built from the shared blocks (workers/models/blocks/): GQA attention without q/k norms and
head_dim = hidden/heads, every layer a softmax top-k MoE with renormalised gate weights (or a
dense SwiGLU for llama). Parameter names follow the Hugging Face Qwen3-MoE / Llama layout
(``model.layers.N.mlp.experts.E.gate_proj.weight`` ...) so checkpoints are ordinary HF-style
safetensors.

Two entry points:
- ``forward(input_ids, ...)``: full-sequence forward (training, scoring, prefill).
- ``forward(..., cache=KVCache)``: incremental decode; the cache grows by the new tokens.
Every forward returns the experts each token was routed to (``routed_experts``,
int64 ``[B, T, num_layers, top_k]``) and accepts ``forced_experts`` of that shape to
replay a routing decision while still computing gate weights from this model's own
router scores (so router gradients flow): the spec's ``router_hook``.

The config is the family's schema itself (workers/models/tiny_moe/config.py TinyMoeConfig, or
workers/models/llama/config.py LlamaConfig).
"""
from __future__ import annotations

import torch
from torch import nn

from workers.models.blocks.attention import Attention, apply_rope, rope_cos_sin  # noqa: F401  (re-exported)
from workers.models.blocks.cache import KVCache  # noqa: F401  (re-exported)
from workers.models.blocks.decoder import (Backbone, CausalLM, ForwardContext, ModelOutput, Routing,  # noqa: F401
                                           dense_mask, right_padded)
from workers.models.blocks.layer import DecoderLayer
from workers.models.blocks.mlp import SwiGLU
from workers.models.blocks.moe_softmax import MoeBlock
from workers.models.blocks.norm import RMSNorm
from workers.models.tiny_moe.config import DecoderConfig, TinyMoeConfig  # noqa: F401  (re-exported)


def decoder_layer(cfg: DecoderConfig) -> DecoderLayer:
    """One tiny_moe / llama layer: plain GQA attention, then the MoE (or, dense, one SwiGLU MLP)."""
    attn = Attention(hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.kv_heads,
                     head_dim=cfg.head_dim, rope_theta=cfg.rope_theta)
    mlp = (SwiGLU(cfg.hidden_size, cfg.dense_intermediate_size) if cfg.is_dense else
           MoeBlock(hidden_size=cfg.hidden_size, num_experts=cfg.num_experts, top_k=cfg.top_k,
                    expert_intermediate_size=cfg.expert_intermediate_size, norm_topk_prob=True))
    return DecoderLayer(hidden_size=cfg.hidden_size, rms_norm_eps=cfg.rms_norm_eps, attention=attn, mlp=mlp)


class TinyMoeForCausalLM(CausalLM):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(nn.Embedding(cfg.vocab_size, cfg.hidden_size),
                              [decoder_layer(cfg) for _ in range(cfg.num_layers)], RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))
        self.make_head()


def build_model(cfg: DecoderConfig, seed: int, dtype: torch.dtype = torch.float32) -> TinyMoeForCausalLM:
    return TinyMoeForCausalLM(cfg).init_weights(seed).to(dtype)


def num_parameters(cfg: DecoderConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in TinyMoeForCausalLM(cfg).parameters())


def build(cfg: DecoderConfig, *, device=None, dtype=None) -> TinyMoeForCausalLM:
    """The module with uninitialised weights (:meth:`CausalLM.create`)."""
    return TinyMoeForCausalLM.create(cfg, device=device, dtype=dtype)


def init(cfg: DecoderConfig, dtype=torch.float32) -> TinyMoeForCausalLM:
    """Step-0 weights (:meth:`CausalLM.step0`): seeded, or the converted ``cfg.pretrained`` checkpoint."""
    return TinyMoeForCausalLM.step0(cfg, dtype)
