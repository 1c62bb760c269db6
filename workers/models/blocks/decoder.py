"""The causal-LM skeleton every family shares, and the forward contract the engine and trainer use.

A family subclasses :class:`CausalLM` and builds ``self.model.layers`` (any mix of attention,
Mamba-2, dense-MLP and MoE layers). Each layer implements ``forward(x, ctx) -> (x, routing)``:
``routing`` is None for a layer without a router, else :class:`Routing` (the experts it chose,
its balance loss and expert load). A layer with a router sets ``routed = True``; Router Replay's
``forced_experts`` ``[B, T, num_routed_layers, top_k]`` is indexed by routed-layer ordinal, and
``routed_experts`` of the output has the same layout (dense layers have no column).

The skeleton owns what every family must do the same way: validity and causal masks (left pads,
KV cache, packed segments), positions, ``logits_mask`` (logits only where a loss needs them) and
tied embeddings. Parameter names are Hugging Face's (``model.embed_tokens``, ``model.layers.N``,
``model.norm``, ``lm_head``), so a checkpoint's state dict loads as is.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.blocks.cache import KVCache
from workers.models.blocks.decode_fused import final_norm
from workers.models.blocks.kernels import fast
from workers.models.blocks.logprobs import Scoring, score_head
from workers.models.blocks.masking import window_band
from workers.models.blocks.varlen import Documents


@dataclasses.dataclass
class ModelOutput:
    logits: Optional[torch.Tensor]  # [B, T, V], or [N, V] under logits_mask; None when scored (``score``)
    aux_loss: torch.Tensor  # scalar load-balancing loss, mean over routed layers (0 for dense)
    routed_experts: torch.Tensor  # [B, T, L_routed, k] int64 ([B, T, 0, 0] for dense)
    expert_load: torch.Tensor  # [L_routed, E] fraction of routed slots per expert
    logp: Optional[torch.Tensor] = None  # [N] log p(target) under ``score`` (chunked, never [N, V])
    entropy: Optional[torch.Tensor] = None  # [N] entropy under ``score`` (no grad)
    head_loss: Optional[torch.Tensor] = None  # scalar: ``score.token_loss`` summed, when the head took it (logp: no grad)


@dataclasses.dataclass
class Routing:
    experts: torch.Tensor  # [B, T, k] int64
    aux_loss: torch.Tensor  # scalar
    load: torch.Tensor  # [E]


@dataclasses.dataclass
class ForwardContext:
    """What a layer needs besides its input: built once per forward by :meth:`CausalLM.forward`."""

    position_ids: torch.Tensor  # [B, T]
    valid: torch.Tensor  # [B, T] bool: non-pad new tokens
    mask: Optional[torch.Tensor]  # [B, 1, T, past+T] bool, None: plain causal (fast path, no pads/cache)
    cache: Optional[KVCache]
    past: int  # cached positions before these tokens
    layer: int = 0  # index of the layer being run (cache slot)
    forced: Optional[torch.Tensor] = None  # [B, T, k] experts to replay in this layer, or None
    forced_mask: Optional[torch.Tensor] = None  # [B, T] bool: where ``forced`` applies
    cp: Optional[Any] = None  # context parallel: this rank's SeqShard (workers/models/blocks/ulysses.py)
    docs: Optional[Documents] = None  # packed rows: attention/scans per document (mask is then None); whole rows under cp
    mask_positions: Optional[torch.Tensor] = None
    """[B, T] key index each mask row sits at, where it is not the last T of the mask's columns (the
    static cache: slot index = position); None: rows are the mask's last T key columns."""
    memo: dict = dataclasses.field(default_factory=dict)

    def shared(self, key: Any, make: Callable[[], Any]) -> Any:
        """Computed once per forward and shared by the layers (rotary tables, ...)."""
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    def window_mask(self, window: Optional[int]) -> Optional[torch.Tensor]:
        """``mask`` for a layer attending to its last ``window`` keys (None: every key): the same
        mask banded to key index > query index - window (workers/models/blocks/masking.py), once per
        window and forward. None stays None: the mask-free paths (plain causal, packed documents)
        take the window themselves (kernels.attend's ``window``)."""
        if window is None or self.mask is None:
            return self.mask

        def band() -> torch.Tensor:
            t, s = self.mask.shape[-2:]
            keys = torch.arange(s, device=self.mask.device)
            rows = keys[s - t:] if self.mask_positions is None else self.mask_positions[:, None]
            return self.mask & window_band(rows, keys, window)
        return self.shared(("window_mask", window), band)


def dense_mask(key_mask: torch.Tensor, t: int, past: int) -> torch.Tensor:
    """[B, t, past+t] bool: causal over cache + new tokens, valid keys only, always self."""
    dev = key_mask.device
    causal = torch.ones(t, past + t, dtype=torch.bool, device=dev).tril(diagonal=past)
    mask = causal[None] & key_mask[:, None, :]
    return mask | torch.eye(t, past + t, dtype=torch.bool, device=dev).roll(past, dims=1)[None]


def right_padded(valid: torch.Tensor) -> bool:
    """True when every row is valid tokens then pads (or no pads): plain causal attention then
    gives every valid query exactly its masked result (pad queries differ, and are ignored)."""
    return valid.shape[1] < 2 or bool((valid[:, :-1] | ~valid[:, 1:]).all())


class Backbone(nn.Module):
    """``model.*`` of an HF causal LM: embeddings, layers, final norm."""

    def __init__(self, embed: nn.Module, layers: list[nn.Module], norm: nn.Module):
        super().__init__()
        self.embed_tokens = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class CausalLM(nn.Module):
    """Subclasses set ``self.config`` and ``self.model`` (a :class:`Backbone`) and call
    :meth:`make_head`. ``config`` needs ``vocab_size``, ``hidden_size``, ``num_layers`` and
    ``tie_word_embeddings`` (False when absent)."""

    @classmethod
    def create(cls, cfg, *, device=None, dtype=None) -> "CausalLM":
        """The module with uninitialised weights on ``device`` (``"meta"``: nothing allocated) in
        ``dtype`` (a torch dtype or its name). Off meta it is made on the CPU first, then moved."""
        from workers.common.dtypes import torch_dtype

        if isinstance(dtype, str):
            dtype = torch_dtype(dtype)
        if str(device) == "meta":
            with torch.device("meta"):
                return cls(cfg).to(dtype=dtype)
        return cls(cfg).to(device=device, dtype=dtype)

    @classmethod
    def step0(cls, cfg, dtype=torch.float32) -> "CausalLM":
        """Step-0 weights on the CPU: a Hugging Face checkpoint directory (``cfg.path``: built on meta,
        streamed in tensor by tensor through the family's ``from_hf``), the converted ``cfg.pretrained``
        checkpoint (HF names, which are this model's), or seeded from ``cfg.init_seed`` (std ``cfg.init_std``)."""
        from workers.common.dtypes import torch_dtype

        if isinstance(dtype, str):
            dtype = torch_dtype(dtype)
        if cfg.path:
            from workers.models.hf_checkpoint import load_pretrained

            return load_pretrained(cls.create(cfg, device="meta", dtype=dtype), cfg)
        if not cfg.pretrained:
            return cls(cfg).init_weights(cfg.init_seed).to(dtype)
        from workers.models.pretrained import load_state_dict, require_prepared  # safetensors only

        model = cls(cfg)
        model.load_state_dict(load_state_dict(require_prepared(cfg)), strict=True)
        return model.to(dtype)

    @torch.no_grad()
    def init_weights(self, seed: int) -> "CausalLM":
        """Deterministic init from ``seed``, independent of the global RNG state: :meth:`seeded_tensors`."""
        state = self.state_dict(keep_vars=True)
        for name, t in self.seeded_tensors(seed):
            state[name].copy_(t)
        return self

    def seeded_tensors(self, seed: int):
        """``(name, float32 tensor)`` of every parameter under its checkpoint name (sorted names, one
        generator: :meth:`init_tensor`; a stacked expert tensor is drawn expert by expert)
        and persistent buffer (:meth:`init_buffer`), ONE AT A TIME and from shapes only, so a model built
        on the meta device and sharded (workers/trainer/parallel/mesh.py ``materialize``) gets the very
        values ``init_weights`` gives the full model without any rank holding all of them. The names
        and full shapes are read NOW (before a sharding plan changes them); the values when iterated."""
        state = self.state_dict(keep_vars=True)  # checkpoint names: each routed expert on its own
        buffer_names = {n for n, _ in self.named_buffers()}
        params = sorted((n, tuple(t.shape)) for n, t in state.items() if n not in buffer_names)
        buffers = [(n, tuple(t.shape)) for n, t in state.items() if n in buffer_names]

        def stream():
            gen = torch.Generator().manual_seed(seed)
            for name, shape in params:
                yield name, self.init_tensor(name, shape, gen)
            for name, shape in buffers:
                yield name, self.init_buffer(name, shape)
        return stream()

    def init_tensor(self, name: str, shape: tuple, gen: torch.Generator) -> torch.Tensor:
        """The default rule: norms 1, every other tensor N(0, std), the residual projections (o_proj,
        down_proj) scaled down by sqrt(2 * num_layers) so the residual stream does not grow."""
        if name.endswith("norm.weight"):
            return torch.ones(shape)
        std = self.config.init_std
        scale = std / math.sqrt(2 * self.config.num_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else std
        return torch.randn(shape, generator=gen) * scale

    def init_buffer(self, name: str, shape: tuple) -> torch.Tensor:
        """A persistent buffer's step-0 value: zeros (the sigmoid router's correction bias, the only one)."""
        return torch.zeros(shape)

    def make_head(self) -> None:
        cfg = self.config
        # Tied: no module of its own, so state_dict() holds the matrix once (as HF checkpoints do).
        tied = getattr(cfg, "tie_word_embeddings", False)
        self.lm_head = None if tied else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def new_cache(self) -> KVCache:
        """An empty inference cache for this model (the engine asks the model, never the family)."""
        return KVCache(len(self.model.layers))

    @property
    def num_routed_layers(self) -> int:
        return sum(1 for layer in self.model.layers if getattr(layer, "routed", False))

    def forward(self, input_ids: torch.Tensor, *, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, cache: Optional[KVCache] = None,
                forced_experts: Optional[torch.Tensor] = None, forced_mask: Optional[torch.Tensor] = None,
                segment_ids: Optional[torch.Tensor] = None, logits_mask: Optional[torch.Tensor] = None,
                cp: Optional[Any] = None, score: Optional[Scoring] = None) -> ModelOutput:
        """``attention_mask`` [B, T] marks valid (non-pad) new tokens; pads may sit anywhere.

        With a cache, keys are the cached ones plus the new ones; attention is causal over the
        concatenation. ``forced_experts`` [B,T,L_routed,k] with optional ``forced_mask`` [B,T]
        replays routing. Every query may also see itself, so pad rows never produce NaN.
        ``segment_ids`` [B, T] (packing, full-sequence forwards only; each segment contiguous, -1 on
        padding): a query attends only to its own segment, Mamba states restart at each segment, and
        no [T, T] mask is built (workers/models/blocks/varlen.py); pass per-segment ``position_ids``.
        ``logits_mask`` [B, T] bool: logits only there, returned flat ``[N, V]`` in row-major order.
        ``cp`` (a workers/models/blocks/ulysses.py ``SeqShard``, training only): the inputs are this
        rank's chunk of the sequence (``position_ids`` its global positions); masks and documents
        come from ``cp.valid`` and ``cp.segment_ids`` over the whole sequence (``ctx.docs`` then
        describes the whole rows: attention after the head all-to-all uses them), and outputs are
        the chunk's.
        ``score`` (with ``logits_mask``): no logits; ``logp`` / ``entropy`` ``[N]`` of its targets,
        computed in chunks (workers/models/blocks/logprobs.py).
        """
        b, t = input_ids.shape
        dev = input_ids.device
        valid = torch.ones(b, t, dtype=torch.bool, device=dev) if attention_mask is None else attention_mask.bool()
        x = self.model.embed_tokens(input_ids)
        docs = None
        if cache is not None and cache.static:  # slots hold every position at its own index: causal by position
            assert position_ids is not None, "a static cache needs explicit positions"
            past, mask = 0, cache.mask(position_ids)
        else:
            past = 0 if cache is None else cache.length
            assert cp is None or cache is None, "context parallelism is for full-sequence (training) forwards"
            if position_ids is None:
                start = past if cp is None else cp.rank * t
                position_ids = torch.arange(start, start + t, device=dev).expand(b, t)
            key_valid, segment_ids = (valid, segment_ids) if cp is None else (cp.valid, cp.segment_ids)
            key_mask = (key_valid if cache is None or cache.key_mask is None
                        else torch.cat([cache.key_mask, valid], dim=1))
            if cache is not None:
                cache.key_mask = key_mask
            if segment_ids is not None:  # packed rows: per-document attention, no [T, T] mask (under cp: whole rows)
                assert cache is None, "sequence packing is for full-sequence forwards"
                docs = Documents.from_segments(torch.where(key_valid, segment_ids, -1))
            fast_causal = (cache is None and segment_ids is None and fast(x)
                           and ((attention_mask is None and cp is None) or right_padded(key_valid)))
            mask = None if (fast_causal or docs is not None) else dense_mask(key_mask, key_valid.shape[1], past)
        ctx = ForwardContext(position_ids=position_ids, valid=valid, mask=None if mask is None else mask[:, None],
                             cache=cache, past=past, forced_mask=forced_mask, cp=cp, docs=docs,
                             mask_positions=position_ids if cache is not None and cache.static else None)
        aux_total = x.new_zeros((), dtype=torch.float32)
        routed, loads = [], []
        for i, layer in enumerate(self.model.layers):
            ctx.layer = i
            ctx.forced = None
            if forced_experts is not None and getattr(layer, "routed", False):
                ctx.forced = forced_experts[:, :, len(routed)]
            x, routing = layer(x, ctx)
            if routing is not None:
                aux_total = aux_total + routing.aux_loss
                routed.append(routing.experts)
                loads.append(routing.load)
        h = final_norm(self.model.norm, x, ctx)
        if logits_mask is not None:
            h = h[logits_mask]
        logits = logp = entropy = head_loss = None
        if score is None:
            logits = self.head(h)
        else:
            assert logits_mask is not None, "score needs logits_mask (which positions predict its targets)"
            logp, entropy, head_loss = score_head(h, score, self.head, weight=self.head_weight())
        if not routed:  # dense: no routed layer, an empty routing record [B, T, 0, 0]
            return ModelOutput(logits=logits, aux_loss=aux_total, expert_load=torch.zeros(0, 0, device=dev),
                               routed_experts=torch.zeros(b, t, 0, 0, dtype=torch.long, device=dev),
                               logp=logp, entropy=entropy, head_loss=head_loss)
        return ModelOutput(logits=logits, aux_loss=aux_total / len(routed), routed_experts=torch.stack(routed, dim=2),
                           expert_load=torch.stack(loads), logp=logp, entropy=entropy, head_loss=head_loss)

    def head_weight(self) -> torch.Tensor:
        """The [V, H] matrix :meth:`head` multiplies by (the fused log-prob head reads it)."""
        return self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of hidden states: ``lm_head``, or the embedding matrix when tied."""
        return self.lm_head(h) if self.lm_head is not None else F.linear(h, self.model.embed_tokens.weight)
