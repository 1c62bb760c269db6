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
from torch.nn.attention import SDPBackend, sdpa_kernel

#: GPU fast paths (grouped-GEMM experts, causal flash attention through SDPA) run on CUDA
#: tensors only, so CPU numerics stay exactly the reference loop's. Tests set this to True
#: to exercise the fast path on CPU against the reference.
FAST_PATH_ON_CPU = False


#: SDPA backends for masked attention on CUDA (decode with a KV cache, left padding). Not
#: cuDNN: it builds a graph per key length, i.e. on every decode step (~100 ms/step seen on H200).
MASKED_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
#: SDPA backends for the causal fast path (training, scoring); None leaves torch's choice (cuDNN on H100/H200).
CAUSAL_SDPA_BACKENDS: Optional[list] = None


def _fast(x: torch.Tensor) -> bool:
    return x.is_cuda or FAST_PATH_ON_CPU


class _GatherSlots(torch.autograd.Function):
    """``x[tok_of]`` (each token once per routed slot, grouped by expert). Backward gathers by
    the inverse permutation and sums each token's k slots: no atomic index_add."""

    @staticmethod
    def forward(ctx, x, tok_of, inv, k):
        ctx.save_for_backward(inv)
        ctx.k = k
        return x.index_select(0, tok_of)

    @staticmethod
    def backward(ctx, g):
        (inv,) = ctx.saved_tensors
        return g.index_select(0, inv).view(inv.numel() // ctx.k, ctx.k, -1).sum(1), None, None, None


class _UnpermuteSum(torch.autograd.Function):
    """``out[t] = sum of y over token t's k slots`` (y in expert order); backward is a gather."""

    @staticmethod
    def forward(ctx, y, tok_of, inv, k):
        ctx.save_for_backward(tok_of)
        return y.index_select(0, inv).view(inv.numel() // k, k, -1).sum(1)

    @staticmethod
    def backward(ctx, g):
        (tok_of,) = ctx.saved_tensors
        return g.index_select(0, tok_of), None, None, None


@dataclasses.dataclass(kw_only=True)
class TinyMoeConfig:
    """Architecture facts of the model; a subset of workers.common.config.ModelConfig."""

    vocab_size: int
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 0  # grouped-query attention; 0 = num_heads
    num_experts: int = 8  # 0 = dense: every layer a SwiGLU MLP (HF Llama names), no router
    top_k: int = 2
    expert_intermediate_size: int = 256
    dense_intermediate_size: int = 0  # the dense MLP's width (num_experts=0)
    tie_word_embeddings: bool = False  # logits = h @ embed_tokens.weight^T; no lm_head module
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def is_dense(self) -> bool:
        return self.num_experts == 0


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
        h, self.nh, self.hd, self.nkv = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.kv_heads
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(self, x, cos, sin, attn_mask, cache: Optional[KVCache], layer: int):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # the cache holds the kv heads only (GQA's memory saving)
            if cache.keys[layer] is not None:
                k = torch.cat([cache.keys[layer], k], dim=2)
                v = torch.cat([cache.values[layer], v], dim=2)
            cache.keys[layer], cache.values[layer] = k, v
        if self.nkv != self.nh:  # query head j*g+i reads kv head j (HF Llama's repeat_kv)
            k = k.repeat_interleave(self.nh // self.nkv, dim=1)
            v = v.repeat_interleave(self.nh // self.nkv, dim=1)
        if attn_mask is None:  # fast path: no pads before any valid key, no cache (flash attention)
            if CAUSAL_SDPA_BACKENDS is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                with sdpa_kernel(CAUSAL_SDPA_BACKENDS):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif q.is_cuda:
            with sdpa_kernel(MASKED_SDPA_BACKENDS):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        else:
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
        if _fast(flat) and self._grouped_ok(flat):
            out = self._experts_grouped(flat, idx, weights)
        else:
            out = self._experts_loop(flat, idx, weights)
        aux, frac = self.balance(idx, probs, valid)
        return out.view(b, t, h), idx.view(b, t, self.top_k), aux, frac

    def balance(self, idx: torch.Tensor, probs: torch.Tensor, valid: Optional[torch.Tensor]):
        """Switch-Transformer balance loss over valid tokens, E * sum_e f_e * P_e, and f [E].

        Separate so the trainer's expert-parallel block (same routing, experts on other
        ranks) returns the very same loss and load.
        """
        vmask = torch.ones(idx.shape[0], device=idx.device) if valid is None else valid.reshape(-1).float()
        n = vmask.sum().clamp_min(1.0)
        if _fast(idx):  # the same counts without one_hot's host sync (it checks the index range)
            onehot = torch.zeros(idx.shape[0], self.num_experts, device=idx.device).scatter_add_(
                1, idx, torch.ones(idx.shape, device=idx.device))
        else:
            onehot = F.one_hot(idx, self.num_experts).float().sum(1)  # [N, E]
        frac = (onehot * vmask[:, None]).sum(0) / (n * self.top_k)
        mean_prob = (probs * vmask[:, None]).sum(0) / n
        aux = self.num_experts * (frac.detach() * mean_prob).sum()
        return aux, frac.detach()

    def _experts_loop(self, flat: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Reference: one index_select / matmul / index_add per expert (host sync per expert)."""
        out = torch.zeros_like(flat)
        for e in range(self.num_experts):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            y = self.experts[e](flat.index_select(0, rows))
            out.index_add_(0, rows, y * weights[rows, slot, None].to(y.dtype))
        return out

    def _grouped_ok(self, flat: torch.Tensor) -> bool:
        """Grouped GEMM needs bf16 operands and plain nn.Linear experts (not swapped modules)."""
        e0 = self.experts[0]
        return (hasattr(F, "grouped_mm") and flat.dtype == torch.bfloat16
                and all(type(getattr(e0, n)) is nn.Linear and getattr(e0, n).weight.dtype == torch.bfloat16
                        for n in ("gate_proj", "up_proj", "down_proj")))

    def _experts_grouped(self, flat: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sort token slots by expert, two grouped GEMMs over all experts, no host sync.

        Same function as the loop up to summation order: each token's k expert outputs are
        summed in one reduction (fp32 accumulate) instead of k bf16 index_adds. The expert
        weights are stacked per call ([E, 2I, H] and [E, H, I]); their gradients flow back to
        the per-expert parameters, whose names stay the HF Qwen3-MoE ones.
        """
        n, h = flat.shape
        k = self.top_k
        expert_ids = idx.reshape(-1)  # [N*k], slot s belongs to token s // k
        order = expert_ids.argsort(stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
            0, expert_ids, torch.ones_like(expert_ids))  # bincount would sync to size its output
        offs = counts.cumsum(0).to(torch.int32)
        tok_of = order // k
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        xs = _GatherSlots.apply(flat, tok_of, inv, k)  # [N*k, H] grouped by expert
        w_gate_up, w_down = self._stacked_weights()
        gate_up = F.grouped_mm(xs, w_gate_up.transpose(1, 2), offs=offs)  # [N*k, 2I]
        g, u = gate_up.chunk(2, dim=-1)
        y = F.grouped_mm(F.silu(g) * u, w_down.transpose(1, 2), offs=offs)  # [N*k, H]
        y = y * weights.reshape(-1).index_select(0, order)[:, None].to(y.dtype)
        return _UnpermuteSum.apply(y, tok_of, inv, k)

    def _stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([E, 2I, H] gate|up, [E, H, I] down). Without autograd (inference) the stack is kept
        until a weight changes (in-place copies bump ``_version``), so decode steps do not
        re-copy every expert; with autograd it is rebuilt so gradients reach the parameters.
        Update weights with ``param.copy_`` (as the engine does), not through ``param.data``,
        whose writes bypass the version counter."""
        # Straight through _modules/_parameters: nn.Module.__getattr__ costs ~2 us a lookup, x 192 a layer.
        ws = [e._modules[n]._parameters["weight"] for e in self.experts._modules.values()
              for n in ("gate_proj", "up_proj", "down_proj")]
        cacheable = not (torch.is_grad_enabled() and any(w.requires_grad for w in ws))
        key = tuple((w.data_ptr(), w._version) for w in ws) if cacheable else None
        cached = self.__dict__.get("_stack_cache")
        if key is not None and cached is not None and cached[0] == key:
            return cached[1]
        stacked = (torch.stack([torch.cat([ws[i], ws[i + 1]]) for i in range(0, len(ws), 3)]),
                   torch.stack(ws[2::3]))
        self.__dict__["_stack_cache"] = (key, stacked) if key is not None else None
        return stacked


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TinyMoeConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # A dense layer's MLP is one SwiGLU block named like HF Llama's (mlp.gate_proj ...).
        self.mlp = Expert(cfg.hidden_size, cfg.dense_intermediate_size) if cfg.is_dense else MoeBlock(cfg)


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
        fast_causal = (cache is None and segment_ids is None and _fast(x)
                       and (attention_mask is None or _right_padded(valid)))
        mask = None if fast_causal else _dense_mask(key_mask, t, past)
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


def _dense_mask(key_mask: torch.Tensor, t: int, past: int) -> torch.Tensor:
    """[B, t, past+t] bool: causal over cache + new tokens, valid keys only, always self."""
    dev = key_mask.device
    causal = torch.ones(t, past + t, dtype=torch.bool, device=dev).tril(diagonal=past)
    mask = causal[None] & key_mask[:, None, :]
    return mask | torch.eye(t, past + t, dtype=torch.bool, device=dev).roll(past, dims=1)[None]


def _right_padded(valid: torch.Tensor) -> bool:
    """True when every row is valid tokens then pads (or no pads): plain causal attention then
    gives every valid query exactly its masked result (pad queries differ, and are ignored)."""
    return valid.shape[1] < 2 or bool((valid[:, :-1] | ~valid[:, 1:]).all())


def build_model(cfg: TinyMoeConfig, seed: int, dtype: torch.dtype = torch.float32) -> TinyMoeForCausalLM:
    return TinyMoeForCausalLM(cfg).init_weights(seed).to(dtype)


def num_parameters(cfg: TinyMoeConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in TinyMoeForCausalLM(cfg).parameters())
