"""tiny_moe: a small causal Mixture-of-Experts decoder in plain torch (and, with no experts, the
dense Llama of model.family=llama).

Shared by the embedded inference engine and the trainer (through the family specs
workers/models/tiny_moe/spec.py and workers/models/llama/spec.py), so both compute the very
same function (the train/inference mismatch then comes only from dtype and kernel
order, which is what Router Replay and the mismatch metrics are about).

Parameter names follow the Hugging Face Qwen3-MoE layout (``model.layers.N.mlp.
experts.E.gate_proj.weight`` ...) so checkpoints are ordinary HF-style safetensors.

Two entry points:
- ``forward(input_ids, ...)``: full-sequence forward (training, scoring, prefill).
- ``forward(..., cache=KVCache)``: incremental decode; the cache grows by the new tokens.
Every forward returns the experts each token was routed to (``routed_experts``,
int64 ``[B, T, num_layers, top_k]``) and accepts ``forced_experts`` of that shape to
replay a routing decision while still computing gate weights from this model's own
router scores (so router gradients flow): the spec's ``router_hook``.

The config is the family's schema itself (workers/models/tiny_moe/config.py TinyMoeConfig, or
workers/models/llama/config.py LlamaConfig); blocks live in layers.py and moe.py.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from workers.common.dtypes import torch_dtype
from workers.models.tiny_moe import layers  # layers.fast: looked up per call, so tests can switch it
from workers.models.tiny_moe.config import DecoderConfig, TinyMoeConfig  # noqa: F401  (re-exported)
from workers.models.tiny_moe.layers import (Attention, Expert, KVCache, RMSNorm, apply_rope,  # noqa: F401
                                            dense_mask, right_padded, rope_cos_sin)
from workers.models.tiny_moe.moe import MoeBlock


@dataclasses.dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, T, V]
    aux_loss: torch.Tensor  # scalar load-balancing loss (Switch-style), mean over layers
    routed_experts: torch.Tensor  # [B, T, L, k] int64
    expert_load: torch.Tensor  # [L, E] fraction of routed slots per expert


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # A dense layer's MLP is one SwiGLU block named like HF Llama's (mlp.gate_proj ...).
        self.mlp = Expert(cfg.hidden_size, cfg.dense_intermediate_size) if cfg.is_dense else MoeBlock(cfg)


class TinyMoeModel(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TinyMoeForCausalLM(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.config = cfg
        self.model = TinyMoeModel(cfg)
        # Tied: no module of its own, so state_dict()/named_parameters() hold the matrix once
        # (as HF checkpoints with tie_word_embeddings do) and its gradient sums both uses.
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @torch.no_grad()
    def init_weights(self, seed: int) -> "TinyMoeForCausalLM":
        """Deterministic init from ``seed`` (independent of the global RNG state)."""
        gen = torch.Generator().manual_seed(seed)
        std = self.config.init_std
        for name, p in sorted(self.named_parameters()):
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                scale = std / math.sqrt(2 * self.config.num_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        cache: Optional[KVCache] = None,
        forced_experts: Optional[torch.Tensor] = None,
        forced_mask: Optional[torch.Tensor] = None,
        segment_ids: Optional[torch.Tensor] = None,
        logits_mask: Optional[torch.Tensor] = None,
    ) -> ModelOutput:
        """``attention_mask`` [B, T] marks valid (non-pad) new tokens; pads may sit anywhere.

        With a cache, keys are the cached ones plus the new ones; attention is causal over
        the concatenation. ``forced_experts`` [B,T,L,k] with optional ``forced_mask`` [B,T]
        replays routing (see MoeBlock.route). Every query may also see itself, so pad rows never produce
        NaN (a fully masked softmax row would poison later layers through 0 * NaN).
        ``segment_ids`` [B, T] (sequence packing, full-sequence forwards only): a query attends
        only to keys of its own segment; pass per-segment ``position_ids`` with it.
        ``logits_mask`` [B, T] bool: compute logits only there, returned flat ``[N, V]`` in
        row-major order. The trainer needs them only where they predict a loss token; on RL
        batches with long prompts that is a small fraction of the lm_head FLOPs and logit bytes.
        """
        b, t = input_ids.shape
        dev = input_ids.device
        valid = torch.ones(b, t, dtype=torch.bool, device=dev) if attention_mask is None else attention_mask.bool()
        past = 0 if cache is None else cache.length
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=dev).expand(b, t)
        key_mask = valid if cache is None or cache.key_mask is None else torch.cat([cache.key_mask, valid], dim=1)
        if cache is not None:
            cache.key_mask = key_mask
        x = self.model.embed_tokens(input_ids)
        fast_causal = (cache is None and segment_ids is None and layers.fast(x)
                       and (attention_mask is None or right_padded(valid)))
        mask = None if fast_causal else dense_mask(key_mask, t, past)
        if segment_ids is not None:
            assert cache is None, "sequence packing is for full-sequence forwards"
            mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, x.dtype)
        aux_total = x.new_zeros((), dtype=torch.float32)
        routed, loads = [], []
        for i, layer in enumerate(self.model.layers):
            x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, None if mask is None else mask[:, None], cache, i)
            if self.config.is_dense:
                x = x + layer.mlp(layer.post_attention_layernorm(x))
                continue
            forced = None if forced_experts is None else forced_experts[:, :, i]
            y, idx, aux, load = layer.mlp(layer.post_attention_layernorm(x), forced, valid, forced_mask)
            x = x + y
            aux_total = aux_total + aux
            routed.append(idx)
            loads.append(load)
        h = self.model.norm(x)
        if logits_mask is not None:
            h = h[logits_mask]
        logits = self.lm_head(h) if self.lm_head is not None else F.linear(h, self.model.embed_tokens.weight)
        if not routed:  # dense: no MoE layer, an empty routing record [B, T, 0, 0]
            return ModelOutput(logits=logits, aux_loss=aux_total, expert_load=torch.zeros(0, 0, device=dev),
                               routed_experts=torch.zeros(b, t, 0, 0, dtype=torch.long, device=dev))
        return ModelOutput(
            logits=logits,
            aux_loss=aux_total / len(self.model.layers),
            routed_experts=torch.stack(routed, dim=2),
            expert_load=torch.stack(loads),
        )


def build_model(cfg: DecoderConfig, seed: int, dtype: torch.dtype = torch.float32) -> TinyMoeForCausalLM:
    return TinyMoeForCausalLM(cfg).init_weights(seed).to(dtype)


def num_parameters(cfg: DecoderConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in TinyMoeForCausalLM(cfg).parameters())


def build(cfg: DecoderConfig, *, device=None, dtype=None) -> TinyMoeForCausalLM:
    """The module with uninitialised weights on ``device`` (``"meta"``: nothing allocated) in ``dtype``
    (a torch dtype or its name). Off meta it is made on the CPU first, then moved, as it always was."""
    if isinstance(dtype, str):
        dtype = torch_dtype(dtype)
    if str(device) == "meta":
        with torch.device("meta"):
            return TinyMoeForCausalLM(cfg).to(dtype=dtype)
    return TinyMoeForCausalLM(cfg).to(device=device, dtype=dtype)


def init(cfg: DecoderConfig, dtype=torch.float32) -> TinyMoeForCausalLM:
    """Step-0 weights on the CPU: seeded from ``cfg.init_seed`` (std ``cfg.init_std``), or the converted
    ``cfg.pretrained`` checkpoint (HF names, which are this model's: the spec's from_hf is the identity)."""
    if isinstance(dtype, str):
        dtype = torch_dtype(dtype)
    if not cfg.pretrained:
        return build_model(cfg, cfg.init_seed, dtype)
    from workers.models.pretrained import load_state_dict, require_prepared  # safetensors only

    model = TinyMoeForCausalLM(cfg)
    model.load_state_dict(load_state_dict(require_prepared(cfg)), strict=True)
    return model.to(dtype)
