"""What a publisher consumes: a model's weights as a stream of FULL HF-named tensors, one at a time.

Why a stream and not a state dict: a sharded trainer (FSDP, TP, EP) would otherwise gather the
whole model on every rank before publishing (a 1T-parameter model does not fit one host). A
:class:`WeightStream` knows every tensor's full name, shape and published dtype up front
(:attr:`metas`, no communication), and :meth:`items` gathers each tensor only when the consumer
reaches it; the consumer writes or sends it and lets it go before asking for the next.

Collective contract: on a sharded model, :meth:`items` is a collective per tensor (an all-gather,
or an expert-parallel broadcast), so EVERY trainer rank iterates the same ``names`` in the same
order to the end, whatever it keeps (ranks that do not own a tensor's file or bucket discard it).
:meth:`local_nonfinite` needs no communication: a NaN or inf is in some rank's shard, so the
ranks' lists together name every bad tensor.

Implementations: :class:`DictStream` (a state dict of plain tensors or DTensors: tools, tests, the
unsharded model) here; the trainer's sharded models (incl. expert parallel) in
workers/trainer/weight_stream.py.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Mapping, NamedTuple, Optional, Sequence, Union

import torch

from workers.common.dtensor import full_tensor, local_part
from workers.weights.base import TensorMeta
from workers.weights.checksums import nonfinite_names

if TYPE_CHECKING:
    from workers.models.blocks.experts import StackedExperts


class WeightStream:
    """Full tensors of one weights version, gathered on demand (module docstring)."""

    metas: list[TensorMeta]
    """Every tensor in the canonical order (the model's state-dict order), full shape, published dtype."""

    def items(self, names: Optional[Sequence[str]] = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) for ``names`` (default: all, canonical order). COLLECTIVE when sharded."""
        raise NotImplementedError

    def local_nonfinite(self) -> list[str]:
        """Names of tensors whose LOCAL part (this rank's shard) holds NaN/inf. No communication."""
        raise NotImplementedError

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metas]

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.metas)


class ExpertSlot(NamedTuple):
    """Where one routed expert's tensor lives in a sharded model: a view of row block ``index`` of
    ``module``'s stacked parameter ``stack`` (``module.split_stack``), held by EP rank ``owner``.
    What the trainer's stream hands a delta tracker instead of its private tuples."""

    module: "StackedExperts"
    prefix: str
    """The module's name in the model with a trailing dot ("" at the root)."""
    stack: str
    owner: int
    index: int


class DictStream(WeightStream):
    """A state dict as a stream: plain tensors as they are, DTensors gathered one at a time when
    reached (``full_tensor``: a collective over their mesh), floating ones cast to ``dtype``.

    ``state`` holds the tensors by this stream's own names; ``ours`` maps each published name to its
    own name, and ``slots`` names the published tensors that are views into a stacked ``state``
    entry (none here; the trainer's stream: workers/trainer/weight_stream.py)."""

    state: Mapping[str, torch.Tensor]
    ours: Mapping[str, str]
    slots: Mapping[str, ExpertSlot]

    def __init__(self, state: Mapping[str, torch.Tensor], dtype: Optional[torch.dtype] = None):
        self.state, self.dtype = state, dtype
        self.metas = [_meta(n, t, dtype) for n, t in state.items()]  # a DTensor's shape is the full one
        self.ours, self.slots = {n: n for n in state}, {}

    def items(self, names: Optional[Sequence[str]] = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.names if names is None else names:
            yield name, cast(full_tensor(self.state[name].detach()), self.dtype)

    def local_nonfinite(self) -> list[str]:
        return nonfinite_names((n, local_part(t.detach())) for n, t in self.state.items())


def cast(t: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """Floating tensors to the published dtype; integer buffers as they are."""
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def _meta(name: str, t: torch.Tensor, dtype: Optional[torch.dtype]) -> TensorMeta:
    out = dtype if dtype is not None and t.is_floating_point() else t.dtype
    return TensorMeta(name, str(out).replace("torch.", ""), tuple(t.shape), t.numel() * out.itemsize)


def meta_of(name: str, shape: Sequence[int], dtype: torch.dtype, published: Optional[torch.dtype]) -> TensorMeta:
    """The TensorMeta of a tensor of full ``shape`` and local ``dtype``, as published."""
    return _meta(name, torch.empty(tuple(shape), dtype=dtype, device="meta"), published)


def as_stream(weights: Union[WeightStream, Mapping[str, torch.Tensor]]) -> WeightStream:
    """Publishers take either; a plain mapping is wrapped (already full, nothing gathered)."""
    return weights if isinstance(weights, WeightStream) else DictStream(weights)
