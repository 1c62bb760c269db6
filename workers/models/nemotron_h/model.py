"""Nemotron-H / Nemotron 3 in torch: hybrid blocks of Mamba-2, attention, dense MLP and LatentMoE.

Each layer is one pre-norm block, ``x + mixer(norm(x))``, whose mixer is chosen by its character
in ``hybrid_override_pattern`` (M Mamba-2, * attention, - MLP, E MoE), as transformers'
NemotronHBlock. Attention is grouped-query with no positional encoding (the reference applies no
RoPE: position lives in the Mamba state). Parameter names are the checkpoints'
(``backbone.embeddings``, ``backbone.layers.N.norm``, ``backbone.layers.N.mixer.*``,
``backbone.norm_f``, ``lm_head``): what ``save_pretrained`` writes and SGLang loads.

Built on the shared skeleton (workers/models/blocks/decoder.py): masks, positions, Router Replay
over the MoE layers only, logits_mask. The inference cache keeps k/v for attention layers and
``(conv window, ssm state)`` for Mamba layers (workers/models/blocks/cache.py).
"""
from __future__ import annotations

import math
import torch
from torch import nn

from workers.common.dtypes import torch_dtype
from workers.models.blocks import kernels, ulysses
from workers.models.blocks.decoder import CausalLM, ForwardContext, Routing
from workers.models.blocks.latent_moe import LatentMoE, ReluSquaredMLP
from workers.models.blocks.mamba2 import Mamba2Mixer
from workers.models.blocks.router_sigmoid import SigmoidTopkRouter
from workers.models.nemotron_h.config import NemotronHConfig


class RMSNorm(nn.Module):
    """Nemotron-H's RMSNorm: the weight multiplies in float32, then the result is cast back."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


class NoPEAttention(nn.Module):
    """Grouped-query attention without positional encoding; the cache keeps kv heads only."""

    kv_slots = True  # the static engine's cache keeps nkv x hd keys/values per position (static_cache.py)

    def __init__(self, cfg: NemotronHConfig):
        super().__init__()
        h, self.nh, self.hd, self.nkv = cfg.hidden_size, cfg.num_heads, cfg.attn_head_dim, cfg.kv_heads
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        cache = ctx.cache
        if cache is not None and cache.static:  # preallocated slots: it writes k/v and attends (grouped heads)
            return self.o_proj(cache.attend(ctx.layer, q, k, v, ctx.mask).transpose(1, 2).reshape(b, t, -1))
        if cache is not None:
            if cache.keys[ctx.layer] is not None:
                k = torch.cat([cache.keys[ctx.layer], k], dim=2)
                v = torch.cat([cache.values[ctx.layer], v], dim=2)
            cache.keys[ctx.layer], cache.values[ctx.layer] = k, v
        if ctx.cp is not None:  # context parallel: this rank's heads over the whole sequence
            out = ulysses.attend(q, k, v, ctx.mask, ctx.cp, scale=self.hd ** -0.5, docs=ctx.docs)
            return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        if self.nkv != self.nh:  # query head j*g+i reads kv head j (the reference's repeat_kv)
            k = k.repeat_interleave(self.nh // self.nkv, dim=1)
            v = v.repeat_interleave(self.nh // self.nkv, dim=1)
        out = kernels.attend(q, k, v, ctx.mask, scale=self.hd ** -0.5, docs=ctx.docs)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class HybridBlock(nn.Module):
    """``x + mixer(norm(x))``; ``forward(x, ctx) -> (x, Routing | None)`` (only MoE blocks route)."""

    def __init__(self, cfg: NemotronHConfig, kind: str):
        super().__init__()
        self.kind = kind
        self.routed = kind == "E"
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        if kind == "M":
            self.mixer = Mamba2Mixer(hidden_size=cfg.hidden_size, num_heads=cfg.mamba_num_heads,
                                     head_dim=cfg.mamba_head_dim, n_groups=cfg.mamba_n_groups,
                                     state_size=cfg.ssm_state_size, conv_kernel=cfg.conv_kernel, eps=cfg.norm_eps,
                                     time_step_min=cfg.time_step_min, conv_bias=cfg.use_conv_bias)
        elif kind == "*":
            self.mixer = NoPEAttention(cfg)
        elif kind == "-":
            self.mixer = ReluSquaredMLP(cfg.hidden_size, cfg.intermediate_size)
        elif kind == "E":
            self.mixer = LatentMoE(hidden_size=cfg.hidden_size, num_experts=cfg.num_experts, top_k=cfg.top_k,
                                   expert_intermediate_size=cfg.expert_intermediate_size,
                                   shared_intermediate_size=cfg.shared_expert_intermediate_size,
                                   latent_size=cfg.moe_latent_size, n_group=cfg.n_group, topk_group=cfg.topk_group,
                                   norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor)
        else:
            raise ValueError(f"model.hybrid_override_pattern: unknown layer kind {kind!r} (M, *, - or E)")

    def forward(self, x: torch.Tensor, ctx: ForwardContext):
        h = self.norm(x)
        if self.kind == "M":
            cache = ctx.cache
            if ctx.docs is not None and ctx.cp is None:  # packed: every document starts from a zero state
                y = ctx.docs.map_runs(lambda r, a, b, doc: self.mixer(h[r:r + 1, a:b], ctx.valid[r:r + 1, a:b])[0])
                return x + y, None
            if cache is not None and cache.static:  # fixed slots: right-padded chunks, state per slot
                y, new_state = self.mixer(h, ctx.valid, cache.read_state(ctx.layer), return_state=True,
                                          right_pads=True, decode=cache.decoding)
                cache.write_state(ctx.layer, new_state)
                return x + y, None
            state = None if cache is None else cache.states[ctx.layer]
            y, new_state = self.mixer(h, ctx.valid, state, return_state=cache is not None, cp=ctx.cp)
            if cache is not None:
                cache.states[ctx.layer] = new_state
            return x + y, None
        if self.kind == "*":
            return x + self.mixer(h, ctx), None
        if self.kind == "-":
            return x + self.mixer(h), None
        y, idx, aux, load = self.mixer(h, ctx.forced, ctx.valid, ctx.forced_mask)
        return x + y, Routing(experts=idx, aux_loss=aux, load=load)


class HybridBackbone(nn.Module):
    """``backbone.*`` of the checkpoint: ``embeddings``, ``layers``, ``norm_f``. The skeleton reads
    ``embed_tokens`` and ``norm``; here they are other names for the same modules."""

    def __init__(self, cfg: NemotronHConfig):
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HybridBlock(cfg, kind) for kind in cfg.hybrid_override_pattern)
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.embeddings

    @property
    def norm(self) -> RMSNorm:
        return self.norm_f


class NemotronHForCausalLM(CausalLM):
    def __init__(self, cfg: NemotronHConfig):
        super().__init__()
        if len(cfg.hybrid_override_pattern) != cfg.num_layers:
            raise ValueError(f"model.num_layers({cfg.num_layers}) != len(model.hybrid_override_pattern)"
                             f"({len(cfg.hybrid_override_pattern)})")
        self.config = cfg
        self.backbone = HybridBackbone(cfg)
        self.make_head()

    @property
    def model(self) -> HybridBackbone:
        """The skeleton's name for the backbone (checkpoints call it ``backbone``)."""
        return self.backbone

    def init_tensor(self, name: str, shape: tuple, gen: torch.Generator) -> torch.Tensor:
        """Seeded init (CausalLM.seeded_tensors), the reference's scheme: normal(init_std) matrices, unit
        norms, zero biases, S4D-real A_log, D = 1, dt_bias = softplus^-1 of a log-uniform dt in
        [time_step_min, time_step_max], out_proj scaled by 1/sqrt(num_layers)."""
        c = self.config
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight") or name.endswith("norm_f.weight") or leaf == "D":
            return torch.ones(shape)
        if leaf == "bias":
            return torch.zeros(shape)
        if leaf == "A_log":
            return torch.log(torch.arange(1, math.prod(shape) + 1, dtype=torch.float32)).view(shape)
        if leaf == "dt_bias":
            lo, hi = math.log(c.time_step_min), math.log(c.time_step_max)
            dt = torch.exp(torch.rand(shape, generator=gen) * (hi - lo) + lo).clamp(min=c.time_step_floor)
            return dt + torch.log(-torch.expm1(-dt))
        scale = 1 / math.sqrt(c.num_layers) if name.endswith("out_proj.weight") else 1.0
        return torch.randn(shape, generator=gen) * c.init_std * scale


def in_dtype(model: NemotronHForCausalLM, dtype) -> NemotronHForCausalLM:
    """``model`` in ``dtype`` (a torch dtype or its name), its routers kept in float32 as the
    reference keeps them (``gate.weight`` and ``e_score_correction_bias``): in bf16 the expert
    choice would otherwise differ from transformers' and SGLang's."""
    if dtype is None:
        return model
    model = model.to(torch_dtype(dtype) if isinstance(dtype, str) else dtype)
    for module in model.modules():
        if isinstance(module, SigmoidTopkRouter):
            module.float()
    return model


def build(cfg: NemotronHConfig, *, device=None, dtype=None) -> NemotronHForCausalLM:
    """Uninitialised weights (``device="meta"`` allocates nothing)."""
    with torch.device(device or "cpu"):
        return in_dtype(NemotronHForCausalLM(cfg), dtype)


def init(cfg: NemotronHConfig, dtype) -> NemotronHForCausalLM:
    """The step-0 model on CPU in ``dtype``: the checkpoint at ``cfg.path`` (streamed; ``mtp.*`` dropped
    by the family's ``from_hf``), else seeded from ``init_seed``."""
    if cfg.path:
        from workers.models.hf_checkpoint import load_pretrained

        return in_dtype(load_pretrained(build(cfg, device="meta", dtype=dtype), cfg), dtype)
    return in_dtype(NemotronHForCausalLM(cfg).init_weights(cfg.init_seed), dtype)

