"""tiny_moe: a small causal Mixture-of-Experts decoder in plain torch.

Shared by the embedded inference engine and the trainer, so both compute the very
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
router scores (so router gradients flow).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(kw_only=True)
class TinyMoeConfig:
    """Architecture facts of the model; a subset of workers.common.config.ModelConfig."""

    vocab_size: int
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_experts: int = 8
    top_k: int = 2
    expert_intermediate_size: int = 256
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclasses.dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, T, V]
    aux_loss: torch.Tensor  # scalar load-balancing loss (Switch-style), mean over layers
    routed_experts: torch.Tensor  # [B, T, L, k] int64
    expert_load: torch.Tensor  # [L, E] fraction of routed slots per expert


class KVCache:
    """Per-layer key/value tensors ``[B, H, T, D]`` plus the key validity mask ``[B, T]``."""

    def __init__(self, num_layers: int):
        self.keys: list[Optional[torch.Tensor]] = [None] * num_layers
        self.values: list[Optional[torch.Tensor]] = [None] * num_layers
        self.key_mask: Optional[torch.Tensor] = None

    @property
    def length(self) -> int:
        return 0 if self.key_mask is None else self.key_mask.shape[1]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows in ``rows`` (finished sequences leave the batch)."""
        self.keys = [k.index_select(0, rows) if k is not None else None for k in self.keys]
        self.values = [v.index_select(0, rows) if v is not None else None for v in self.values]
        if self.key_mask is not None:
            self.key_mask = self.key_mask.index_select(0, rows)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the compute dtype, as HF models do.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.float()[..., None] * inv  # [B, T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [B, 1, T, D]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: TinyMoeConfig):
        super().__init__()
        h, self.nh, self.hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, h, bias=False)
        self.v_proj = nn.Linear(h, h, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(self, x, cos, sin, attn_mask, cache: Optional[KVCache], layer: int):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            if cache.keys[layer] is not None:
                k = torch.cat([cache.keys[layer], k], dim=2)
                v = torch.cat([cache.values[layer], v], dim=2)
            cache.keys[layer], cache.values[layer] = k, v
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Expert(nn.Module):
    def __init__(self, h: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoeBlock(nn.Module):
    """Top-k router + experts. Gate weights always come from this model's router."""

    def __init__(self, cfg: TinyMoeConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, cfg.expert_intermediate_size) for _ in range(cfg.num_experts))

    def route(self, x: torch.Tensor, forced: Optional[torch.Tensor], forced_mask: Optional[torch.Tensor] = None):
        """Returns (indices [N,k], weights [N,k], probs [N,E]) for flat tokens x [N,H].

        ``forced`` [N,k] replaces the top-k choice (Router Replay); where ``forced_mask``
        [N] is False the router's own top-k is kept (tokens inference did not report).
        """
        probs = F.softmax(self.gate(x).float(), dim=-1)
        idx = probs.topk(self.top_k, dim=-1).indices
        if forced is not None:
            forced = forced.long()
            idx = forced if forced_mask is None else torch.where(forced_mask.bool()[:, None], forced, idx)
        weights = probs.gather(-1, idx)
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-9)
        return idx, weights, probs

    def forward(self, x: torch.Tensor, forced: Optional[torch.Tensor], valid: Optional[torch.Tensor],
                forced_mask: Optional[torch.Tensor] = None):
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        idx, weights, probs = self.route(flat, None if forced is None else forced.reshape(-1, self.top_k),
                                         None if forced_mask is None else forced_mask.reshape(-1))
        out = torch.zeros_like(flat)
        for e in range(self.num_experts):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            y = self.experts[e](flat.index_select(0, rows))
            out.index_add_(0, rows, y * weights[rows, slot, None].to(y.dtype))
        # Switch-Transformer balance loss over valid tokens: E * sum_e f_e * P_e.
        vmask = torch.ones(b * t, device=x.device) if valid is None else valid.reshape(-1).float()
        n = vmask.sum().clamp_min(1.0)
        onehot = F.one_hot(idx, self.num_experts).float().sum(1)  # [N, E]
        frac = (onehot * vmask[:, None]).sum(0) / (n * self.top_k)
        mean_prob = (probs * vmask[:, None]).sum(0) / n
        aux = self.num_experts * (frac.detach() * mean_prob).sum()
        return out.view(b, t, h), idx.view(b, t, self.top_k), aux, frac.detach()


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TinyMoeConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoeBlock(cfg)


class TinyMoeModel(nn.Module):
    def __init__(self, cfg: TinyMoeConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TinyMoeForCausalLM(nn.Module):
    def __init__(self, cfg: TinyMoeConfig):
        super().__init__()
        self.config = cfg
        self.model = TinyMoeModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

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
    ) -> ModelOutput:
        """``attention_mask`` [B, T] marks valid (non-pad) new tokens; pads may sit anywhere.

        With a cache, keys are the cached ones plus the new ones; attention is causal over
        the concatenation. ``forced_experts`` [B,T,L,k] with optional ``forced_mask`` [B,T]
        replays routing (see MoeBlock.route). Every query may also see itself, so pad rows never produce
        NaN (a fully masked softmax row would poison later layers through 0 * NaN).
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
        causal = torch.ones(t, past + t, dtype=torch.bool, device=dev).tril(diagonal=past)
        mask = causal[None] & key_mask[:, None, :]
        mask = mask | torch.eye(t, past + t, dtype=torch.bool, device=dev).roll(past, dims=1)[None]
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, x.dtype)
        aux_total = x.new_zeros((), dtype=torch.float32)
        routed, loads = [], []
        for i, layer in enumerate(self.model.layers):
            x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, mask[:, None], cache, i)
            forced = None if forced_experts is None else forced_experts[:, :, i]
            y, idx, aux, load = layer.mlp(layer.post_attention_layernorm(x), forced, valid, forced_mask)
            x = x + y
            aux_total = aux_total + aux
            routed.append(idx)
            loads.append(load)
        logits = self.lm_head(self.model.norm(x))
        return ModelOutput(
            logits=logits,
            aux_loss=aux_total / len(self.model.layers),
            routed_experts=torch.stack(routed, dim=2),
            expert_load=torch.stack(loads),
        )


def build_model(cfg: TinyMoeConfig, seed: int, dtype: torch.dtype = torch.float32) -> TinyMoeForCausalLM:
    return TinyMoeForCausalLM(cfg).init_weights(seed).to(dtype)


def num_parameters(cfg: TinyMoeConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in TinyMoeForCausalLM(cfg).parameters())
