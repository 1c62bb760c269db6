"""Fixed-capacity expert-parallel dispatch: the MoE all-to-alls without split sizes on the host.

``all_to_all_single`` needs its split sizes on the host, so the exact dispatch of
workers/trainer/parallel/expert.py reads ``2 * ep`` ints per MoE block and micro-batch: a host
sync per layer that stalls the GPU's queue. Here (``trainer.parallel.ep_capacity_factor`` > 0)
every rank sends each EP peer exactly ``C`` rows, a size fixed for the whole step:

  C = ceil(factor * slots / ep), rounded up to a multiple of 8, where slots = top_k x the tokens
      of the largest forward any rank runs this step (/ tp when the tp ranks split the tokens),
      agreed by one all-reduce (max) and host read when the step starts.

Per MoE block the rows go through :func:`~workers.trainer.parallel.expert_exchange.fixed_exchange` (all on
the device: equal splits, padded buffers, device-side offsets).

Overflow: a rank with more than C slots for one peer sends only the first C (the rest come back
zero) and sets the block's device flag. The step (:class:`StepCapacity`, driven by
workers/trainer/step.py) reads the flags ONCE, after every micro-batch's backward (one
all-reduce over all ranks, one host read), and if any rank overflowed the whole step's
forward/backward is run again with the exact dispatch: never a silently dropped token. The redo
is counted (``ep_overflow_steps`` in the step statistics, cumulative) and warned about.
With no overflow the rows each expert sees, and their order, are the exact dispatch's: the same
loss, gradients and weights (tests/integration/test_ep_capacity.py).
"""
from __future__ import annotations

import contextlib
import logging
import math
from typing import TYPE_CHECKING, Callable, Optional, TypeVar

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from workers.trainer.parallel.expert import ExpertParallel
    from workers.trainer.parallel.dims import ParallelDims

log = logging.getLogger(__name__)
T = TypeVar("T")


def capacity(max_tokens: int, *, factor: float, top_k: int, ep: int, tp: int) -> int:
    """Rows each rank sends each EP peer (module docstring): ``max_tokens`` is the largest forward's
    token count (padding included) over every rank this step."""
    slots = -(-max_tokens // tp) * top_k
    rows = math.ceil(factor * slots / ep)
    return max(8, -(-rows // 8) * 8)


def configure(model: nn.Module, factor: float) -> None:
    """Set ``trainer.parallel.ep_capacity_factor`` on every EP block of ``model`` (0: exact dispatch)."""
    for par in _blocks(model, armed_only=False):
        par.capacity_factor = factor
    model.__dict__.setdefault("ep_overflow_steps", 0)


def _blocks(model: nn.Module, *, armed_only: bool = True) -> list["ExpertParallel"]:
    found = [m.__dict__["expert_parallel"] for m in model.modules() if "expert_parallel" in m.__dict__]
    found = [p for p in found if p.ep_group is not None]
    return [p for p in found if p.capacity_factor > 0] if armed_only else found


class StepCapacity:
    """One training step's fixed-capacity dispatch: arm every block with the step's C, read the
    overflow flags once, redo with the exact dispatch when any rank overflowed."""

    def __init__(self, model: nn.Module, blocks: list["ExpertParallel"], dims: "ParallelDims"):
        self.model, self.blocks, self.dims = model, blocks, dims

    @classmethod
    def begin(cls, model: nn.Module, forwards: list[torch.Tensor], dims: "ParallelDims") -> Optional["StepCapacity"]:
        """Arm ``model``'s blocks for forwards of these ``input_ids`` (COLLECTIVE over all ranks when
        there is any block: one all-reduce (max) of the largest forward, read on the host); None
        without fixed-capacity blocks."""
        blocks = _blocks(model)
        if not blocks:
            return None
        largest = torch.tensor([max(ids.numel() for ids in forwards)], dtype=torch.int64, device=dims.device)
        if dims.group is not None and dims.world_size > 1:
            dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=dims.group)
        largest = int(largest[0])
        for par in blocks:
            par.capacity = capacity(largest, factor=par.capacity_factor, top_k=par.top_k, ep=par.ep, tp=par.tp)
            par.overflow = None
        return cls(model, blocks, dims)

    def overflowed(self) -> bool:
        """Did any block of any rank overflow since :meth:`begin` (COLLECTIVE: one all-reduce, one host read)?"""
        flags = [p.overflow for p in self.blocks if p.overflow is not None]
        flag = (torch.stack(flags).any() if flags else torch.zeros((), dtype=torch.bool, device=self.dims.device))
        flag = flag.to(torch.int32).reshape(1)
        if self.dims.group is not None and self.dims.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.dims.group)
        for p in self.blocks:
            p.overflow = None
        return bool(flag[0])

    def redo_exact(self, run: Callable[[], T]) -> T:
        """``run()`` again with the exact dispatch (the step's forward/backward), counted and warned."""
        self.model.ep_overflow_steps = getattr(self.model, "ep_overflow_steps", 0) + 1
        log.warning("expert-parallel dispatch overflowed its fixed capacity (%s rows per peer, "
                    "trainer.parallel.ep_capacity_factor=%s): step redone with exact dispatch (%d so far)",
                    self.blocks[0].capacity, self.blocks[0].capacity_factor, self.model.ep_overflow_steps)
        with self.exact():
            return run()

    @contextlib.contextmanager
    def exact(self):
        saved = [p.capacity for p in self.blocks]
        for p in self.blocks:
            p.capacity = None
        try:
            yield
        finally:
            for p, c in zip(self.blocks, saved):
                p.capacity = c

    def end(self) -> None:
        """Disarm: forwards outside a training step (no bound agreed) use the exact dispatch."""
        for p in self.blocks:
            p.capacity, p.overflow = None, None
