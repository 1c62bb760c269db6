"""The preallocated KV cache of the static decode path: one fixed slot per running sequence.

Why: the dynamic :class:`~workers.models.blocks.cache.KVCache` grows by ``torch.cat`` every step
and is re-padded when rows join or leave, so every step allocates, copies and changes shapes: no
CUDA graph can replay it and the host spends more time than the GPU. Here every layer owns one
buffer of ``num_slots x max_len`` positions allocated once:

- GQA layers (workers/models/blocks/attention.py): keys and values ``[S, L, kv_heads, head_dim]``
  (time before heads, so one token's write is one contiguous row; SDPA reads the transposed view);
- MLA layers (workers/models/blocks/mla.py): the normed latent + rotated key ``[S, L, r + dr]``,
  and where a DSA indexer scores the keys (GLM-5, workers/models/blocks/dsa_indexer.py) its keys
  ``[S, L, index_head_dim]`` in ``index_keys``, written and read the same way;
- Mamba-2 layers (workers/models/blocks/mamba2.py, nemotron_h): ``states`` = (conv window
  ``[S, conv_dim, kernel - 1]``, SSM state ``[S, H, P, N]`` float32), no time axis. Unlike keys, a
  state is not addressed by position, so it must be zeroed when a slot is admitted (:meth:`reset`),
  and a decode step updates only live rows (``live``: the engine's active-and-not-done flags),
  since rows that are not live -- free slots, finished ones, every row in a graph's warm-up runs
  -- still run the step. Right-padded prefill chunks hold a row's state over its pads (the
  mixer's ``right_pads``), so chunks and rows of any length carry exactly their own state.

A sequence keeps position ``p`` at index ``p`` of its slot (no left padding), so the attention
mask is simply ``key index <= query position``: a forward writes its new keys at their positions
first, then attends over the whole slot. Anything at an index above a sequence's current position
is stale (a previous owner of the slot, a padded prefill column) and is masked until a real token
overwrites it, which is why slots are reused without clearing.

The engine picks the rows of a forward with :meth:`use`: a prefix ``0..B-1`` for decode (views,
no copy: what the CUDA graphs capture), or any slot list for a prefill (a gather), and the key
``window``: attention reads positions ``[0, window)`` only, a bound the engine knows on the host
(every running sequence's next positions), so a short batch does not read the whole slot.

A layer may cache nothing (an MLP or MoE block of a hybrid model). A layer with more than one
attention or mixer is not supported: :func:`unsupported_reason` names it and the engine falls
back to the dynamic cache.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from workers.models.blocks import kernels
from workers.models.blocks.cache import KVCache
from workers.models.blocks.decode_attention import decode_attention
from workers.models.blocks.mamba2 import Mamba2Mixer
from workers.models.blocks.masking import with_sinks
from workers.models.blocks.mla import MLAttention


def _cached_modules(layer: nn.Module) -> list[nn.Module]:
    """What a layer keeps between steps: GQA attention (``kv_slots``), MLA, or a Mamba-2 mixer."""
    return [m for m in layer.modules() if isinstance(m, (MLAttention, Mamba2Mixer)) or getattr(m, "kv_slots", False)]


def unsupported_reason(model: nn.Module) -> Optional[str]:
    """None when every layer caches at most one GQA k/v, MLA latent (+ DSA keys) or Mamba-2 state
    (a model that keeps another cache says why in ``static_cache_unsupported``: the generic path)."""
    if getattr(model, "static_cache_unsupported", None):
        return model.static_cache_unsupported
    for i, layer in enumerate(model.model.layers):
        found = _cached_modules(layer)
        if len(found) > 1:
            return f"layer {i} ({type(layer).__name__}) has {len(found)} attention/mixer modules, the slots hold one"
    return None


class StaticKVCache(KVCache):
    """``num_slots`` sequences of up to ``max_len`` positions for every layer of ``model``."""

    static = True

    def __init__(self, model: nn.Module, *, num_slots: int, max_len: int, device, dtype: torch.dtype):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"static KV cache: {reason}")
        super().__init__(len(model.model.layers))
        self.num_slots, self.max_len = num_slots, max_len
        for i, layer in enumerate(model.model.layers):
            for m in _cached_modules(layer):
                if isinstance(m, Mamba2Mixer):
                    self.states[i] = m.empty_state(num_slots, device, dtype)
                elif isinstance(m, MLAttention):
                    self.keys[i] = torch.zeros(num_slots, max_len, m.r + m.dr, device=device, dtype=dtype)
                    if m.indexer is not None:
                        self.index_keys[i] = torch.zeros(num_slots, max_len, m.indexer.d, device=device, dtype=dtype)
                else:
                    shape = (num_slots, max_len, m.nkv, m.hd)
                    self.keys[i] = torch.zeros(shape, device=device, dtype=dtype)
                    self.values[i] = torch.zeros(shape, device=device, dtype=dtype)
        self.key_index = torch.arange(max_len, device=device)
        self.all_slots = torch.arange(num_slots, device=device)
        self.slots, self.prefix, self.window = self.all_slots, True, max_len
        self._pos: Optional[torch.Tensor] = None
        self._grouped: Optional[tuple] = None  # (mask, (g, dtype), additive grouped mask) of this forward
        self.live: Optional[torch.Tensor] = None  # [B] bool: rows whose recurrent state may change (None: all)

    @property
    def length(self) -> int:
        return self.max_len

    @property
    def bytes(self) -> int:
        tensors = self.keys + self.values + self.index_keys + [t for st in self.states if st for t in st]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def reset(self, slots: torch.Tensor) -> None:
        """Zero the recurrent states of newly admitted ``slots`` (keys need no clearing: masked)."""
        for st in self.states:
            for t in st or ():
                t[slots] = 0

    def use(self, slots: torch.Tensor, prefix: bool) -> None:
        """Rows of the next forwards: ``slots`` [B]; ``prefix`` promises ``slots == arange(B)``
        (decode steps; prefills gather their slots)."""
        self.slots, self.prefix = slots, prefix

    decoding = property(lambda self: self.prefix, doc="A decode step (one token per row), not a prefill chunk.")

    def mask(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Starts a forward at ``position_ids`` [B, T] (remembered for the writes); returns the
        attention mask [B, T, window]: a query sees the keys at indices up to its position."""
        self._pos, self._grouped = position_ids, None
        return self.key_index[None, None, :self.window] <= position_ids[:, :, None]

    def _grouped_mask(self, mask: torch.Tensor, g: int, dtype: torch.dtype) -> torch.Tensor:
        """``mask`` [B, 1, T, window] (the forward's ``ctx.mask``) as the additive [B, 1, g*T, window] mask of :meth:`attend`'s grouped
        query rows, made once per forward, not once per layer: SDPA would turn a bool mask into an
        additive one in every layer, and the expand is a copy (two of a decode step's few hundred
        tiny kernels, per layer). Same values as SDPA's own conversion (0 where seen, -inf else)."""
        if self._grouped is None or self._grouped[0] is not mask or self._grouped[1] != (g, dtype):
            b, _, t, n = mask.shape
            m = mask[:, :, None].expand(b, 1, g, t, n).reshape(b, 1, g * t, n)
            add = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))
            self._grouped = (mask, (g, dtype), add)
        return self._grouped[2]

    def _rows(self, buf: torch.Tensor) -> torch.Tensor:
        n, w = self.slots.shape[0], self.window
        return buf[:n, :w] if self.prefix else buf[:, :w].index_select(0, self.slots)

    def _write(self, buf: torch.Tensor, new: torch.Tensor) -> None:
        """``new`` [B, T, ...] goes to each row's slot at its positions (index_put: graph-safe)."""
        buf[self.slots[:, None], self._pos] = new

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
               scale: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Store k/v ``[B, kv_heads, T, D]`` and attend with q ``[B, heads, T, D]`` over the slot.

        GQA without repeating keys: the ``g = heads / kv_heads`` query heads reading one kv head
        (HF's ``repeat_kv`` layout: query head ``j*g+i`` reads kv head ``j``) become ``g*T`` query
        rows of that kv head, so attention reads the cache once instead of copying it g times.
        ``mask`` [B, 1, T, window] (a sliding window is already in it: slots index positions);
        ``scale`` None: 1/sqrt(D); ``sinks`` [heads]: the sink key joins before the rows are formed
        (workers/models/blocks/masking.py), so each query row keeps its own head's sink logit."""
        self._write(self.keys[layer], k.transpose(1, 2))
        self._write(self.values[layer], v.transpose(1, 2))
        keys, values = self._slot_kv(layer)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if sinks is not None:
            q, keys, values, mask = with_sinks(q, keys, values, mask, sinks, scale)
        b, h, t, d = q.shape
        hkv, g = keys.shape[1], h // keys.shape[1]
        out = self._grouped_attend(q.reshape(b, hkv, g * t, d), keys, values, mask, g, scale)
        return out.reshape(b, h, t, out.shape[-1])

    def attend_written(self, layer: int, rows: torch.Tensor, mask: torch.Tensor,
                       scale: Optional[float] = None) -> torch.Tensor:
        """:meth:`attend` for one token per row whose k/v are already in the slots (the fused decode
        step, workers/models/blocks/decode_fused.py): ``rows`` [B, kv_heads, g, D] (query head
        ``j*g+i`` at ``[:, j, i]``); returns [B, kv_heads, g, D] (possibly strided)."""
        scale = rows.shape[-1] ** -0.5 if scale is None else scale
        add = self._grouped_mask(mask, 1, rows.dtype)[:, 0, 0]  # [B, window]: every grouped row sees the same keys
        return decode_attention(rows, self._rows(self.keys[layer]), self._rows(self.values[layer]), add, scale)

    def positions(self) -> torch.Tensor:
        """The positions [B, T] of this forward's tokens (where their keys go)."""
        return self._pos

    def _slot_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' keys and values [B, kv_heads, window, D] (views in decode)."""
        return (self._rows(self.keys[layer]).transpose(1, 2), self._rows(self.values[layer]).transpose(1, 2))

    def _grouped_attend(self, rows, keys, values, mask, g: int, scale: float) -> torch.Tensor:
        return kernels.attend(rows, keys, values, self._grouped_mask(mask, g, rows.dtype), scale)

    def write_latent(self, layer: int, entry: torch.Tensor) -> torch.Tensor:
        """Store MLA's ``[B, T, r + dr]`` entries; returns the rows' slots over the key window."""
        self._write(self.keys[layer], entry)
        return self._rows(self.keys[layer])

    def write_index_keys(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """Store the DSA indexer's ``[B, T, D]`` keys; returns the rows' slots over the key window."""
        self._write(self.index_keys[layer], keys)
        return self._rows(self.index_keys[layer])

    def read_state(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The rows' recurrent state (views for a decode prefix, a gather for a prefill)."""
        n = self.slots.shape[0]
        return tuple(t[:n] if self.prefix else t.index_select(0, self.slots) for t in self.states[layer])

    def write_state(self, layer: int, new: tuple[torch.Tensor, ...]) -> None:
        """Store the rows' new state; rows that are not ``live`` keep theirs (in place: graph-safe)."""
        n = self.slots.shape[0]
        for buf, t in zip(self.states[layer], new):
            if self.live is not None:
                old = buf[:n] if self.prefix else buf.index_select(0, self.slots)
                t = torch.where(self.live.view(-1, *[1] * (t.dim() - 1)), t.to(buf.dtype), old)
            if self.prefix:
                buf[:n].copy_(t)
            else:
                buf[self.slots] = t.to(buf.dtype)

    # The dynamic cache's batch surgery has no meaning for fixed slots.
    def select(self, rows):  # pragma: no cover - a programming error, not a run-time path
        raise TypeError("StaticKVCache: rows leave by freeing their slot, not by select")

    merge = pad_left = trim_left = select
