"""The preallocated KV cache of the static decode path: one fixed slot per running sequence.

Why: the dynamic :class:`~workers.models.blocks.cache.KVCache` grows by ``torch.cat`` every step
and is re-padded when rows join or leave, so every step allocates, copies and changes shapes: no
CUDA graph can replay it and the host spends more time than the GPU. Here every layer owns one
buffer of ``num_slots x max_len`` positions allocated once:

- GQA layers (workers/models/blocks/attention.py): keys and values ``[S, L, kv_heads, head_dim]``
  (time before heads, so one token's write is one contiguous row; SDPA reads the transposed view);
- MLA layers (workers/models/blocks/mla.py): the normed latent + rotated key ``[S, L, r + dr]``.

A sequence keeps position ``p`` at index ``p`` of its slot (no left padding), so the attention
mask is simply ``key index <= query position``: a forward writes its new keys at their positions
first, then attends over the whole slot. Anything at an index above a sequence's current position
is stale (a previous owner of the slot, a padded prefill column) and is masked until a real token
overwrites it, which is why slots are reused without clearing.

The engine picks the rows of a forward with :meth:`use`: a prefix ``0..B-1`` for decode (views,
no copy: what the CUDA graphs capture), or any slot list for a prefill (a gather), and the key
``window``: attention reads positions ``[0, window)`` only, a bound the engine knows on the host
(every running sequence's next positions), so a short batch does not read the whole slot.

Families whose layers keep other state (Mamba-2 recurrent state: nemotron_h; the DSA indexer's
keys: glm_moe_dsa) are not supported here: :func:`unsupported_reason` names the layer and the
engine falls back to the dynamic cache.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from workers.models.blocks import kernels
from workers.models.blocks.attention import Attention
from workers.models.blocks.cache import KVCache
from workers.models.blocks.mla import MLAttention


def _attention_of(layer: nn.Module) -> Optional[nn.Module]:
    found = [m for m in layer.modules() if isinstance(m, (Attention, MLAttention))]
    return found[0] if len(found) == 1 else None


def unsupported_reason(model: nn.Module) -> Optional[str]:
    """None when every layer caches only GQA keys/values or an MLA latent; else why not."""
    for i, layer in enumerate(model.model.layers):
        att = _attention_of(layer)
        if att is None:
            return f"layer {i} ({type(layer).__name__}) has no single GQA/MLA attention (recurrent state?)"
        if isinstance(att, MLAttention) and (att.indexer is not None or att.reuses_index):
            return f"layer {i} uses the DSA indexer (its index keys have no static slot yet)"
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
            att = _attention_of(layer)
            if isinstance(att, MLAttention):
                self.keys[i] = torch.zeros(num_slots, max_len, att.r + att.dr, device=device, dtype=dtype)
            else:
                shape = (num_slots, max_len, att.nkv, att.hd)
                self.keys[i] = torch.zeros(shape, device=device, dtype=dtype)
                self.values[i] = torch.zeros(shape, device=device, dtype=dtype)
        self.key_index = torch.arange(max_len, device=device)
        self.all_slots = torch.arange(num_slots, device=device)
        self.slots, self.prefix, self.window = self.all_slots, True, max_len
        self._pos: Optional[torch.Tensor] = None

    @property
    def length(self) -> int:
        return self.max_len

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values if t is not None)

    def use(self, slots: torch.Tensor, prefix: bool) -> None:
        """Rows of the next forwards: ``slots`` [B]; ``prefix`` promises ``slots == arange(B)``."""
        self.slots, self.prefix = slots, prefix

    def mask(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Starts a forward at ``position_ids`` [B, T] (remembered for the writes); returns the
        attention mask [B, T, window]: a query sees the keys at indices up to its position."""
        self._pos = position_ids
        return self.key_index[None, None, :self.window] <= position_ids[:, :, None]

    def _rows(self, buf: torch.Tensor) -> torch.Tensor:
        n, w = self.slots.shape[0], self.window
        return buf[:n, :w] if self.prefix else buf[:, :w].index_select(0, self.slots)

    def _write(self, buf: torch.Tensor, new: torch.Tensor) -> None:
        """``new`` [B, T, ...] goes to each row's slot at its positions (index_put: graph-safe)."""
        buf[self.slots[:, None], self._pos] = new

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """Store k/v ``[B, kv_heads, T, D]`` and attend with q ``[B, heads, T, D]`` over the slot.

        GQA without repeating keys: the ``g = heads / kv_heads`` query heads reading one kv head
        (HF's ``repeat_kv`` layout: query head ``j*g+i`` reads kv head ``j``) become ``g*T`` query
        rows of that kv head, so attention reads the cache once instead of copying it g times."""
        self._write(self.keys[layer], k.transpose(1, 2))
        self._write(self.values[layer], v.transpose(1, 2))
        keys = self._rows(self.keys[layer]).transpose(1, 2)  # [B, kv_heads, L, D], a view in decode
        values = self._rows(self.values[layer]).transpose(1, 2)
        b, h, t, d = q.shape
        hkv, g, n = keys.shape[1], h // keys.shape[1], self.window
        rows = q.reshape(b, hkv, g * t, d)
        m = mask[:, :, None].expand(b, 1, g, t, n).reshape(b, 1, g * t, n)
        out = kernels.attend(rows, keys, values, m)
        return out.reshape(b, h, t, out.shape[-1])

    def write_latent(self, layer: int, entry: torch.Tensor) -> torch.Tensor:
        """Store MLA's ``[B, T, r + dr]`` entries; returns the rows' slots over the key window."""
        self._write(self.keys[layer], entry)
        return self._rows(self.keys[layer])

    # The dynamic cache's batch surgery has no meaning for fixed slots.
    def select(self, rows):  # pragma: no cover - a programming error, not a run-time path
        raise TypeError("StaticKVCache: rows leave by freeing their slot, not by select")

    merge = pad_left = trim_left = select
