"""Expert parallelism of the mesh plan: routed experts split over the ``ep`` mesh dimension,
tokens moved by all-to-all, the local experts run as one grouped GEMM.

Layout (workers/trainer/parallel/mesh.py): EP rank r owns experts ``[r * E/ep, (r+1) * E/ep)`` of every
MoE block: the block's :class:`~workers.models.blocks.experts.StackedExperts` narrowed to those
rows, whose state dict names them by GLOBAL expert id (``mlp.experts.5.up_proj.weight`` exists on
the ranks of EP rank 1 when E/ep = 4). The ep
ranks of one EP group hold different rows of the batch; the tp ranks of a TP group hold the SAME
rows (attention is tensor parallel). Inside a MoE block (:class:`ExpertParallel`, which the
block calls from ``routed_experts`` instead of its own expert loop):

  1. the router ran on all tokens, replicated over tp (identical on the TP peers);
  2. tp > 1: each TP rank keeps 1/tp of the tokens (:class:`_ScatterTokens`, backward: all-gather
     of the gradient), so the experts do not compute the same rows tp times;
  3. dispatch: the (token, slot) copies sorted by global expert; per-expert counts exchanged with
     one ``all_to_all_single`` of ``[ep, E/ep]`` ints (stays on the device), then the rows with
     ``all_to_all_single_autograd`` (torch.distributed._functional_collectives: its backward is
     the reverse all-to-all; checked on gloo, torch 2.13);
  4. the local experts on what arrived, regrouped by local expert: ONE grouped GEMM per
     projection on the GPU path (``F.grouped_mm`` with device-side offsets, no host sync);
     the CPU path loops over the local experts (CPU runs are tests and the local loop);
  5. combine: the reverse all-to-all, the k slots weighted by the gate and summed, then
     tp > 1: all-gather over tp (:class:`_GatherTokens`, backward: this rank's slice).

Host syncs: ``all_to_all_single`` needs its split sizes on the host, so the EXACT dispatch reads
``2 * ep`` ints per MoE block and micro-batch (one ``tolist`` of the stacked send/receive
totals). The trainer's default is the fixed-capacity dispatch instead
(``trainer.parallel.ep_capacity_factor`` > 0, workers/trainer/parallel/expert_capacity.py): equal splits of a
per-step size C, padded buffers, device-side offsets, no host sync in the block; a step in which
some peer would get more than C rows is redone exactly. With ep = 1 there is no exchange and no sync.

Gradients: the experts' parameters are fully_shard-ed over the expert-data-parallel mesh
(``dp_shard x tp``: the ranks holding the same experts, with different tokens), whose
reduce-scatter sums their gradients.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workers.common.config.trainer import experts_per_rank
from workers.models.blocks.experts import StackedExperts
from workers.trainer.parallel.expert_exchange import exact_exchange, fixed_exchange, inverse


class _ScatterTokens(torch.autograd.Function):
    """Forward: this TP rank's slice of replicated rows; backward: all-gather of the slices'
    gradients (every TP rank then holds the same full gradient, as its replicated input needs)."""

    @staticmethod
    def forward(ctx, x, group, rank, size):
        ctx.group, ctx.size = group, size
        return x.chunk(size)[rank].contiguous()

    @staticmethod
    def backward(ctx, g):
        parts = [torch.empty_like(g) for _ in range(ctx.size)]
        dist.all_gather(parts, g.contiguous(), group=ctx.group)
        return torch.cat(parts), None, None, None


class _GatherTokens(torch.autograd.Function):
    """Forward: all-gather of the TP ranks' slices (the output is replicated); backward: the
    gradient of a replicated output is the same on every TP rank, so take this rank's slice."""

    @staticmethod
    def forward(ctx, x, group, rank, size):
        ctx.rank, ctx.size = rank, size
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, g):
        return g.chunk(ctx.size)[ctx.rank].contiguous(), None, None, None


class ExpertParallel:
    """What a MoE block's ``routed_experts(flat, idx, weights)`` runs under the mesh plan (module
    docstring). Not an nn.Module: the block keeps it in ``__dict__`` (no parameters of its own)."""

    def __init__(self, experts: StackedExperts, *, num_experts: int, top_k: int, ep_group: Optional[dist.ProcessGroup],
                 ep: int, tp_group: Optional[dist.ProcessGroup], tp: int, tp_rank: int):
        self.experts, self.num_experts, self.top_k = experts, num_experts, top_k
        self.ep_group, self.ep = ep_group, ep
        self.tp_group, self.tp, self.tp_rank = tp_group, tp, tp_rank
        self.capacity_factor = 0.0  # trainer.parallel.ep_capacity_factor (ep_capacity.configure)
        self.capacity: Optional[int] = None  # rows per peer this step (expert_capacity.StepCapacity); None: exact
        self.overflow: Optional[torch.Tensor] = None  # device flag: a peer got more than ``capacity`` slots

    def __call__(self, flat: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n, h = flat.shape
        k = self.top_k
        if self.tp > 1:
            pad = (-n) % self.tp  # zero rows on expert 0 with gate weight 0: no output, no gradient
            if pad:
                flat, idx, weights = (F.pad(t, (0, 0, 0, pad)) for t in (flat, idx, weights))
            flat = _ScatterTokens.apply(flat, self.tp_group, self.tp_rank, self.tp)
            weights = _ScatterTokens.apply(weights, self.tp_group, self.tp_rank, self.tp)
            idx = idx.chunk(self.tp)[self.tp_rank]
        slots = idx.reshape(-1)  # slot s is (token s // k, choice s % k)
        order = slots.argsort(stable=True)
        xs = flat.index_select(0, order // k)  # grouped by global expert
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
            0, slots, torch.ones_like(slots))
        if self.ep_group is None:
            ys = self.experts(xs, counts)
        else:
            ys = self._exchange(xs, counts)
        y = ys.index_select(0, inverse(order)).view(-1, k, h)
        out = (y * weights[..., None].to(y.dtype)).sum(1)
        if self.tp > 1:
            out = _GatherTokens.apply(out, self.tp_group, self.tp_rank, self.tp)[:n]
        return out

    def _exchange(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by global expert -> this rank's experts (all-to-all) -> back, same order."""
        if self.capacity is None:
            return exact_exchange(xs, counts, self.experts, ep=self.ep, group=self.ep_group)
        # No host sync: workers/trainer/parallel/expert_capacity.py sized ``capacity`` for the step.
        ys, overflow = fixed_exchange(xs, counts, self.experts, ep=self.ep, group=self.ep_group, cap=self.capacity)
        self.overflow = overflow if self.overflow is None else self.overflow | overflow
        return ys


def shard_experts(block: nn.Module, *, ep_group, ep: int, ep_rank: int, tp_group, tp: int,
                  tp_rank: int, ep_mesh=None) -> StackedExperts:
    """Keep this EP rank's experts of ``block`` (a MoE block with ``experts``, ``num_experts``,
    ``top_k`` and ``routed_experts``) and route its expert compute through :class:`ExpertParallel`.
    Experts saved as whole stacks (GPT-OSS's, with ``distribute_over_ep``) become DTensors sharded
    over ``ep_mesh`` instead of narrowed (workers/models/blocks/moe_gpt_oss.py says why)."""
    e = block.num_experts
    experts_per_rank(e, ep)  # ValueError naming trainer.parallel.ep
    if ep > 1 and hasattr(block.experts, "distribute_over_ep"):
        block.experts.distribute_over_ep(ep_mesh)
    else:
        block.experts.narrow_(ep_rank * e // ep, e // ep)
    block.__dict__["expert_parallel"] = ExpertParallel(block.experts, num_experts=e, top_k=block.top_k,
                                                       ep_group=ep_group if ep > 1 else None, ep=ep,
                                                       tp_group=tp_group, tp=tp, tp_rank=tp_rank)
    return block.experts
