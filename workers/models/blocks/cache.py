"""The inference cache every family uses: what the embedded engine stores between decode steps.

One class for all families so the engine never asks which family it serves:
- attention layers keep ``keys[i]`` / ``values[i]`` with time on dim -2: ``[B, H, T, D]`` (GQA
  keeps kv heads only) or ``[B, T, D]`` (MLA may keep its latent as ``keys[i]``, ``values[i]`` None);
- recurrent layers (Mamba-2) keep ``states[i]``, a tuple of tensors with the batch first and
  no time axis (conv window, SSM state);
- ``index_keys[i]`` ``[B, T, D]``: a second time-indexed slot per layer, for what a layer caches
  besides its attention keys (the DeepSeek Sparse Attention indexer's keys, GLM-5);
- ``key_mask`` ``[B, T]`` marks valid cached key positions (left padding is False).

Batch operations (rows leave with :meth:`select`, new prefills join with :meth:`merge`) treat
each kind by its shape: time-indexed tensors are left-padded to a common length, states are
only concatenated over the batch.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


class KVCache:
    static = False
    """True for the preallocated slot cache (workers/inference/embedded/static_cache.py): layers
    then write into fixed buffers through its ``attend`` / ``write_latent`` instead of growing lists."""

    def __init__(self, num_layers: int):
        self.keys: list[Optional[torch.Tensor]] = [None] * num_layers
        self.values: list[Optional[torch.Tensor]] = [None] * num_layers
        self.index_keys: list[Optional[torch.Tensor]] = [None] * num_layers
        self.states: list[Optional[tuple]] = [None] * num_layers
        self.key_mask: Optional[torch.Tensor] = None

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def length(self) -> int:
        return 0 if self.key_mask is None else self.key_mask.shape[1]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows in ``rows`` (finished sequences leave the batch)."""
        self.keys = [_rows(k, rows) for k in self.keys]
        self.values = [_rows(v, rows) for v in self.values]
        self.index_keys = [_rows(v, rows) for v in self.index_keys]
        self.states = [None if s is None else tuple(_rows(t, rows) for t in s) for s in self.states]
        if self.key_mask is not None:
            self.key_mask = self.key_mask.index_select(0, rows)

    def pad_left(self, length: int) -> "KVCache":
        """Left-pad every time axis to ``length`` (zeros under key_mask False: never attended to)."""
        pad = length - self.length
        if pad > 0:
            self.keys = [None if k is None else F.pad(k, (0, 0, pad, 0)) for k in self.keys]
            self.values = [None if v is None else F.pad(v, (0, 0, pad, 0)) for v in self.values]
            self.index_keys = [None if v is None else F.pad(v, (0, 0, pad, 0)) for v in self.index_keys]
            self.key_mask = F.pad(self.key_mask, (pad, 0), value=False)
        return self

    def merge(self, other: "KVCache") -> "KVCache":
        """This cache's rows followed by ``other``'s (a new prefill joins the decode batch)."""
        length = max(self.length, other.length)
        a, b = self.pad_left(length), other.pad_left(length)
        a.keys = [_cat(x, y) for x, y in zip(a.keys, b.keys)]
        a.values = [_cat(x, y) for x, y in zip(a.values, b.values)]
        a.index_keys = [_cat(x, y) for x, y in zip(a.index_keys, b.index_keys)]
        a.states = [None if x is None else tuple(torch.cat([u, w]) for u, w in zip(x, y))
                    for x, y in zip(a.states, b.states)]
        a.key_mask = torch.cat([a.key_mask, b.key_mask])
        return a

    def trim_left(self) -> None:
        """Drop leading columns no row attends to (left padding of rows that have left)."""
        if self.key_mask is None or self.key_mask.shape[1] == 0:
            return
        first = int(self.key_mask.any(0).int().argmax())
        if first > 0:
            self.keys = [None if k is None else k[..., first:, :] for k in self.keys]
            self.values = [None if v is None else v[..., first:, :] for v in self.values]
            self.index_keys = [None if v is None else v[..., first:, :] for v in self.index_keys]
            self.key_mask = self.key_mask[:, first:]


def _rows(t: Optional[torch.Tensor], rows: torch.Tensor) -> Optional[torch.Tensor]:
    return None if t is None else t.index_select(0, rows)


def _cat(x: Optional[torch.Tensor], y: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if x is None else torch.cat([x, y])
