"""GPT-OSS in plain torch from the shared blocks: the module the trainer and the embedded engine run.

Per layer (the pre-norm layer, workers/models/blocks/layer.py): GQA attention (blocks/attention.py)
with q/k/v/o biases, a learned sink logit per head (``self_attn.sinks``), YaRN rotary
(blocks/rope_scaled.py, ``truncate`` as configured: off in the released models) and, per
``layer_types``, a sliding window of ``sliding_window`` keys or full attention; then the MoE of
blocks/moe_gpt_oss.py (biased router, softmax over the top-k logits, clamped-SwiGLU experts with
biases, in transformers' fused layout). Parameter names and shapes are the checkpoint's, so a bf16
GptOss checkpoint loads with ``load_state_dict(strict=True)`` and ``state_dict()`` is one
transformers loads. Every layer is routed: Router Replay's ``forced_experts`` has one column per layer.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from workers.models.blocks.attention import Attention
from workers.models.blocks.decoder import Backbone, CausalLM
from workers.models.blocks.layer import DecoderLayer
from workers.models.blocks.moe_gpt_oss import GptOssMoe
from workers.models.blocks.norm import RMSNorm
from workers.models.blocks.rope_scaled import Rope
from workers.models.gpt_oss.config import GptOssConfig


def rope_of(cfg: GptOssConfig) -> Rope:
    if cfg.rope_scaling == "default":
        return Rope(dim=cfg.head_dim, theta=cfg.rope_theta)
    return Rope(dim=cfg.head_dim, theta=cfg.rope_theta, scaling="yarn", factor=cfg.rope_factor,
                original_max_position_embeddings=cfg.rope_original_max_position_embeddings,
                beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow, truncate=cfg.rope_truncate)


def gpt_oss_layer(cfg: GptOssConfig, i: int) -> DecoderLayer:
    h = cfg.hidden_size
    attn = Attention(hidden_size=h, num_heads=cfg.num_heads, num_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                     rope_theta=cfg.rope_theta, rope=rope_of(cfg), qkv_bias=cfg.attention_bias,
                     o_bias=cfg.attention_bias, sinks=True,
                     sliding_window=cfg.sliding_window if cfg.is_sliding(i) else None)
    mlp = GptOssMoe(hidden_size=h, num_experts=cfg.num_experts, top_k=cfg.top_k,
                    expert_intermediate_size=cfg.expert_intermediate_size, swiglu_alpha=cfg.swiglu_alpha,
                    swiglu_limit=cfg.swiglu_limit)
    return DecoderLayer(hidden_size=h, rms_norm_eps=cfg.rms_norm_eps, attention=attn, mlp=mlp)


class GptOssForCausalLM(CausalLM):
    def __init__(self, cfg: GptOssConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(nn.Embedding(cfg.vocab_size, cfg.hidden_size),
                              [gpt_oss_layer(cfg, i) for i in range(cfg.num_layers)], RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))
        self.make_head()

    def init_tensor(self, name: str, shape: tuple, gen: torch.Generator) -> torch.Tensor:
        """The default rule, with transformers' GPT-OSS choices: projection and expert biases 0 (the router's
        bias and the sinks drawn like weights), the experts' down projections scaled like ``down_proj.weight``."""
        if name.endswith("bias") and not name.endswith("router.bias"):
            return torch.zeros(shape)
        if name.endswith("experts.down_proj"):
            return torch.randn(shape, generator=gen) * (self.config.init_std / math.sqrt(2 * self.config.num_layers))
        return super().init_tensor(name, shape, gen)


def build(cfg: GptOssConfig, *, device=None, dtype=None) -> GptOssForCausalLM:
    return GptOssForCausalLM.create(cfg, device=device, dtype=dtype)


def init(cfg: GptOssConfig, dtype=torch.float32) -> GptOssForCausalLM:
    return GptOssForCausalLM.step0(cfg, dtype)
