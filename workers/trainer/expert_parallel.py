"""Expert parallelism: routed experts sharded over the EP group, tokens moved by all-to-all.

Layout (Megatron-Core's): the ``ep`` ranks of an EP group hold DIFFERENT rows of the batch
(attention is data parallel over them) and disjoint experts: EP rank r owns experts
``[r * E/ep, (r+1) * E/ep)``. Inside one MoE layer, per rank:

  1. route: top-k over this model's router (or the replayed experts, Router Replay) ->
     ``idx [N, k]``, gate weights from this router either way;
  2. dispatch: the N*k (token, slot) copies sorted by expert; per-expert counts swapped
     with one all-to-all of ``[ep, E/ep]`` ints, then the hidden states with
     ``all_to_all_single`` (uneven splits: rank r receives what every peer routed to r);
  3. local experts on what arrived (one contiguous segment per local expert);
  4. combine: the reverse all-to-all returns each output to the rank and slot it came from;
  5. with tp > 1 the expert MLPs are tensor parallel too (gate/up column, down row): the
     partial outputs are summed over the TP group after the combine, then weighted by the
     gate weights and summed over the k slots.
The backward of an all-to-all is the all-to-all with the splits swapped (:class:`_AllToAll`).

Backends: gloo (CPU) implements ``all_to_all_single`` with uneven splits in torch 2.13
(checked), so CPU and NCCL run this same code. DeepEP (GPU clusters) would replace steps
2 and 4 with ``deep_ep.Buffer.dispatch / combine``; it is not wired in (nothing here can
build or test it), see :class:`AllToAllDispatcher` for the seam.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from workers.models.blocks.mlp import Expert
from workers.models.blocks.moe_softmax import MoeBlock
from workers.trainer.tensor_parallel import copy_to, reduce_from, shard_linear


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class AllToAllDispatcher:
    """Moves (token, slot) rows to the EP rank owning their expert and back.

    ``dispatch(xs, counts)`` takes rows sorted by global expert with ``counts [E]`` and returns
    (rows for this rank's experts, per-local-expert counts, a handle); ``combine(ys, handle)``
    returns the outputs in the original order. With ep == 1 both are identities.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], ep: int, num_experts: int):
        self.group, self.ep, self.num_local = group, ep, num_experts // ep

    def dispatch(self, xs: torch.Tensor, counts: torch.Tensor):
        if self.group is None:
            return xs, counts, None
        send = counts.view(self.ep, self.num_local)  # [dest rank, its local expert]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send.contiguous(), group=self.group)  # [source rank, my expert]
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        got = _AllToAll.apply(xs, out_splits, in_splits, self.group)
        # Arrived rows are grouped by source, then expert: regroup by expert (stable sort).
        expert_of_row = torch.arange(self.num_local, device=xs.device).repeat(self.ep).repeat_interleave(recv.flatten())
        order = expert_of_row.argsort(stable=True)
        return got.index_select(0, order), recv.sum(0), (order, in_splits, out_splits)

    def combine(self, ys: torch.Tensor, handle) -> torch.Tensor:
        if handle is None:
            return ys
        order, in_splits, out_splits = handle
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return _AllToAll.apply(ys.index_select(0, back), in_splits, out_splits, self.group)


class ExpertParallelMoeBlock(MoeBlock):
    """MoeBlock with this rank's experts only (TP-sharded when tp > 1) and EP token exchange.

    Same router and rule (``MoeBlock.route``), same balance loss (``MoeBlock.balance``);
    ``experts`` is a ModuleDict keyed by the GLOBAL expert index, so parameter names are the
    HF ones (``mlp.experts.5.up_proj.weight`` lives on the rank that owns expert 5).
    """

    def __init__(self, full: MoeBlock, *, ep_group, ep: int, ep_rank: int, tp_group, tp: int, tp_rank: int):
        nn.Module.__init__(self)
        self.num_experts, self.top_k, self.norm_topk_prob = full.num_experts, full.top_k, full.norm_topk_prob
        if self.num_experts % ep:
            raise ValueError(f"expert parallel ep({ep}) must divide num_experts({self.num_experts})")
        self.gate = full.gate
        local = range(ep_rank * self.num_experts // ep, (ep_rank + 1) * self.num_experts // ep)
        self.first_expert = local.start
        self.experts = nn.ModuleDict({str(e): _shard_expert(full.experts[e], tp_rank, tp) for e in local})
        self.tp_group = tp_group
        self.dispatcher = AllToAllDispatcher(ep_group, ep, self.num_experts)

    def forward(self, x, forced, valid, forced_mask=None):
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        idx, weights, probs = self.route(flat, None if forced is None else forced.reshape(-1, self.top_k),
                                         None if forced_mask is None else forced_mask.reshape(-1))
        slots = idx.reshape(-1)  # slot s is (token s // k, choice s % k)
        order = slots.argsort(stable=True)
        xs = copy_to(flat, self.tp_group).index_select(0, order // self.top_k)
        counts = torch.bincount(slots, minlength=self.num_experts)
        rows, local_counts, handle = self.dispatcher.dispatch(xs, counts)
        outs = [self.experts[str(self.first_expert + e)](seg)
                for e, seg in enumerate(rows.split(local_counts.tolist())) if seg.shape[0]]
        ys = torch.cat(outs) if outs else rows.new_zeros((0, h))
        ys = reduce_from(self.dispatcher.combine(ys, handle), self.tp_group)  # [N*k, H] in `order`
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        y = ys.index_select(0, inv).view(-1, self.top_k, h)
        out = (y * weights[..., None].to(y.dtype)).sum(1)
        aux, frac = self.balance(idx, probs, valid)
        return out.view(b, t, h), idx.view(b, t, self.top_k), aux, frac


def _shard_expert(full: Expert, tp_rank: int, tp: int) -> Expert:
    e = Expert.__new__(Expert)
    nn.Module.__init__(e)
    e.gate_proj = shard_linear(full.gate_proj, 0, tp_rank, tp)
    e.up_proj = shard_linear(full.up_proj, 0, tp_rank, tp)
    e.down_proj = shard_linear(full.down_proj, 1, tp_rank, tp)
    return e
