"""The deepseek_v3 torch model (DeepseekV3ForCausalLM's checkpoint names), from shared blocks.

Layer ``i``: RMSNorm -> MLA (workers/models/blocks/mla.py) -> residual -> RMSNorm -> a dense
SwiGLU MLP for ``i < num_dense_layers``, else the sigmoid-routed MoE with shared experts
(workers/models/blocks/moe_sigmoid.py) -> residual. Rotary tables (YaRN when configured) are
computed once per forward and shared by the layers. The skeleton (embedding, masks, Router
Replay, routing records, lm_head) is workers/models/blocks/decoder.py.

Not built: the multi-token-prediction layers (``num_mtp_layers``); a checkpoint's
``model.layers.{num_layers}...`` tensors are theirs and are skipped (``hf_config.is_mtp``, the spec's ``not_built``) before a
strict load. glm_moe_dsa (workers/models/glm_moe_dsa/model.py) reuses this with its indexer.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from workers.common.dtypes import torch_dtype
from workers.models.blocks.decoder import Backbone, CausalLM, ForwardContext, Routing
from workers.models.blocks.mla import MLAttention
from workers.models.blocks.moe_sigmoid import SigmoidMoe
from workers.models.blocks.router_sigmoid import SigmoidTopkRouter
from workers.models.deepseek_v3.config import DeepseekV3Config, rope_of
from workers.models.blocks.mlp import Expert
from workers.models.blocks.norm import RMSNorm


def make_attention(cfg: DeepseekV3Config, layer: int) -> MLAttention:
    rope = rope_of(cfg)
    return MLAttention(hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, q_lora_rank=cfg.q_lora_rank,
                       kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                       qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                       softmax_scale=rope.softmax_scale(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim),
                       interleaved=cfg.rope_interleave)


class DeepseekV3Layer(nn.Module):
    """Pre-norm MLA + (dense or routed) MLP: ``forward(x, ctx) -> (x, Routing | None)``."""

    def __init__(self, cfg: DeepseekV3Config, layer: int, attention: nn.Module):
        super().__init__()
        self.rope = rope_of(cfg)
        self.routed = layer >= cfg.num_dense_layers
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SigmoidMoe(cfg) if self.routed else Expert(cfg.hidden_size, cfg.dense_intermediate_size)

    def forward(self, x: torch.Tensor, ctx: ForwardContext):
        cos, sin = ctx.shared("rope", lambda: self.rope.cos_sin(ctx.position_ids, x.dtype))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        h = self.post_attention_layernorm(x)
        if not self.routed:
            return x + self.mlp(h), None
        y, idx, aux, load = self.mlp(h, ctx.forced, ctx.valid, ctx.forced_mask)
        return x + y, Routing(experts=idx, aux_loss=aux, load=load)


class DeepseekV3ForCausalLM(CausalLM):
    attention = staticmethod(make_attention)
    """Builds layer ``i``'s attention (glm_moe_dsa adds the sparse-attention indexer)."""

    def __init__(self, cfg: DeepseekV3Config):
        super().__init__()
        self.config = cfg
        layers = [DeepseekV3Layer(cfg, i, self.attention(cfg, i)) for i in range(cfg.num_layers)]
        self.model = Backbone(nn.Embedding(cfg.vocab_size, cfg.hidden_size), layers,
                              RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))
        self.make_head()

    @torch.no_grad()
    def init_weights(self, seed: int) -> "DeepseekV3ForCausalLM":
        """Deterministic init from ``seed`` (independent of the global RNG): norms 1 (biases 0), every
        other weight normal(0, init_std), the router's correction bias 0 (a buffer)."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in sorted(self.named_parameters()):
            if re.search(r"norm\.weight$", name):
                p.fill_(1.0)
            elif re.search(r"norm\.bias$", name):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * self.config.init_std)
        for name, b in self.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
        return self


def build_module(cls, cfg, *, device=None, dtype=None):
    """``cls(cfg)`` with uninitialised weights on ``device`` (``"meta"``: nothing allocated) in ``dtype``."""
    if isinstance(dtype, str):
        dtype = torch_dtype(dtype)
    if str(device) == "meta":
        with torch.device("meta"):
            return keep_fp32(cls(cfg).to(dtype=dtype))
    return keep_fp32(cls(cfg).to(device=device, dtype=dtype))


def keep_fp32(model: nn.Module) -> nn.Module:
    """Routers (weights and correction bias) and the DSA indexer's head weights stay float32 whatever the
    compute dtype, as in the checkpoints and transformers: the bias update's small steps and the top-k
    choices would round differently in bf16."""
    for name, mod in model.named_modules():
        if isinstance(mod, SigmoidTopkRouter) or name.endswith("indexer.weights_proj"):
            mod.float()
    return model


def init_module(cls, cfg, dtype=torch.float32):
    """Step-0 weights on the CPU: the checkpoint at ``cfg.path`` (streamed tensor by tensor; MTP
    layers dropped by the family's ``from_hf``), else seeded from ``cfg.init_seed``."""
    if isinstance(dtype, str):
        dtype = torch_dtype(dtype)
    if cfg.path:
        from workers.models.hf_checkpoint import load_pretrained

        return keep_fp32(load_pretrained(build_module(cls, cfg, device="meta", dtype=dtype), cfg))
    if cfg.pretrained:
        raise ValueError(f"model.pretrained={cfg.pretrained!r}: family {cfg.family} has no pretrained sources")
    return keep_fp32(cls(cfg).init_weights(cfg.init_seed).to(dtype))


def build(cfg: DeepseekV3Config, *, device=None, dtype=None) -> DeepseekV3ForCausalLM:
    return build_module(DeepseekV3ForCausalLM, cfg, device=device, dtype=dtype)


def init(cfg: DeepseekV3Config, dtype=torch.float32) -> DeepseekV3ForCausalLM:
    return init_module(DeepseekV3ForCausalLM, cfg, dtype)
