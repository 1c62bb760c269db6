"""Which adapter each token's LoRA product uses when one frozen base trains several adapters
(``trainer.lora.adapters``, issue 44 item 5).

Layout: every targeted ``nn.Linear`` holds the N adapters side by side, ``lora_A`` [N*r, in] and
``lora_B`` [out, N*r] (adapter ``i``'s block: rows / columns ``i*r .. i*r + r``). A token of adapter
``i`` keeps block ``i`` of ``x @ A^T`` and zeroes the others (a 0/1 mask), so

    y = base(x) + s * ((x @ A^T) * mask) @ B^T

is, per token, exactly its own adapter's ``s * (x @ A_i^T) @ B_i^T`` (the other blocks add exact
zeros), computed for the whole batch by the same two matmuls as one adapter: no per-row Python loop,
no gather of per-row factors. Gradients stay apart for the same reason: a token's mask is 0 on every
other adapter's block, so adapter ``i``'s factors get gradient from its own rows only. The cost is N
times the (small) rank-r LoRA products, which is why the config caps N
(workers/common/config/lora.py MAX_ADAPTERS). The same trick serves several adapters on the
embedded engine (workers/inference/embedded/lora.py).

:class:`AdapterRows` is the one object every LoRA module of a model shares: the trainer sets each
forward's per-token adapter ids (``use``) before calling the model, and they stay until the next
forward, so activation checkpointing's recomputation in the backward sees the same mask.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


class AdapterRows:
    """The per-token adapter choice of the current forward (module docstring)."""

    def __init__(self, names: Sequence[str], rank: int):
        self.names, self.rank = tuple(names), int(rank)
        self._ids: Optional[torch.Tensor] = None
        self._masks: dict[torch.dtype, torch.Tensor] = {}

    @property
    def num_adapters(self) -> int:
        return len(self.names)

    def use(self, ids: torch.Tensor) -> None:
        """Adapter index of every token of the next forward, shaped like its ``input_ids`` ([B, T], packed
        or not), each in ``0..N-1`` (the batch loader checks the file's: workers/trainer/batch.py)."""
        self._ids, self._masks = ids.long(), {}

    def mask(self, xa: torch.Tensor) -> torch.Tensor:
        """The 0/1 mask for ``xa`` = ``x @ A^T`` ([..., N*r], the tokens of the ids given to :meth:`use`)."""
        if self._ids is None:
            raise RuntimeError(f"a model with several LoRA adapters {list(self.names)} was called without each "
                               f"row's adapter (AdapterRows.use: the batch's adapter_ids)")
        m = self._masks.get(xa.dtype)
        if m is None or m.device != xa.device:
            table = torch.eye(self.num_adapters, dtype=xa.dtype, device=xa.device).repeat_interleave(self.rank, dim=1)
            m = self._masks[xa.dtype] = table.index_select(0, self._ids.to(xa.device).reshape(-1))
        if m.shape[0] * m.shape[1] != xa.numel():
            raise RuntimeError(f"LoRA input has {xa.numel() // max(xa.shape[-1], 1)} tokens, the adapter ids given "
                               f"cover {m.shape[0]}")
        return m.view(xa.shape)


def rows_of(model) -> Optional[AdapterRows]:
    """The model's shared :class:`AdapterRows` (None: zero or one adapter)."""
    return getattr(model, "lora_rows", None)
