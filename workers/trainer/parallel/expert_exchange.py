"""The row exchange of one expert-parallel MoE block: rows sorted by global expert go to the EP
rank that owns their expert, through its local experts, and come back in the same order.

Why a module of its own: the exchange is tensors and a process group, nothing else. The block
(:class:`~workers.trainer.parallel.expert.ExpertParallel`) chooses which exchange runs and keeps
the overflow flag; the step (:mod:`workers.trainer.parallel.expert_capacity`) chooses the capacity and reads
the flags. Both import this module, and it imports neither of them.

Exact (:func:`exact_exchange`): ``all_to_all_single`` needs its split sizes on the host, so it
reads ``2 * ep`` ints per block and micro-batch (one ``tolist``), a host sync per layer.

Fixed capacity (:func:`fixed_exchange`, every peer sent exactly ``cap`` rows), all on the device:
  1. per-(destination, local expert) counts exchanged as in the exact path (one small
     all-to-all whose result stays on the device);
  2. the send buffer ``[ep * C, h]``: row ``d * C + j`` is the j-th slot bound for peer d (slots
     are sorted by global expert, so by destination), or a zero row past that peer's count;
  3. rows all-to-all with equal splits ``[C] * ep`` (autograd: the backward is the reverse one);
  4. the arrived rows, regrouped by local expert with the padding last, go through the local
     experts with device-side offsets (the grouped GEMM; padding rows are past the last offset
     and come out zero);
  5. the reverse all-to-all, and each slot picks its row back out of the returned buffer.
A peer with more than ``cap`` slots gets only the first ``cap`` (the rest come back zero) and the
returned device flag is set: the step redoes itself exactly (workers/trainer/parallel/expert_capacity.py).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

#: The local experts: ``experts(rows, counts_per_local_expert, padded=...)`` (StackedExperts).
Experts = Callable[..., torch.Tensor]


def exact_exchange(xs: torch.Tensor, counts: torch.Tensor, experts: Experts, *, ep: int,
                   group: dist.ProcessGroup) -> torch.Tensor:
    """Rows sorted by global expert (``counts [E]`` of them per expert) -> this rank's experts
    (all-to-all) -> back, same order. One host sync (the split sizes)."""
    local = counts.numel() // ep
    send = counts.view(ep, local)  # [destination EP rank, its local expert]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send.contiguous(), group=group)  # [source EP rank, my expert]
    in_splits, out_splits = torch.stack([send.sum(1), recv.sum(1)]).tolist()  # the block's one host sync
    got = all_to_all_single_autograd(xs.contiguous(), out_splits, in_splits, group)
    # Arrived rows are grouped by source rank, then expert: regroup by local expert (stable).
    expert_of_row = torch.arange(local, device=xs.device).repeat(ep).repeat_interleave(
        recv.flatten(), output_size=sum(out_splits))
    regroup = expert_of_row.argsort(stable=True)
    ys = experts(got.index_select(0, regroup), recv.sum(0))
    back = ys.index_select(0, inverse(regroup)).contiguous()
    return all_to_all_single_autograd(back, in_splits, out_splits, group)


def fixed_exchange(xs: torch.Tensor, counts: torch.Tensor, experts: Experts, *, ep: int,
                   group: dist.ProcessGroup, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`exact_exchange`, every peer sent exactly ``cap`` rows (module docstring). Returns
    the rows and the device flag "some peer had more than ``cap`` slots"."""
    local = counts.numel() // ep
    n, h = xs.shape
    dev = xs.device
    send = counts.view(ep, local)  # [destination EP rank, its local expert]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send.contiguous(), group=group)  # [source EP rank, my expert]: stays on the device
    per_peer = send.sum(1)
    start = per_peer.cumsum(0) - per_peer  # first slot bound for each peer
    overflow = (per_peer > cap).any()
    j = torch.arange(cap, device=dev)
    src = torch.where(j < per_peer[:, None], start[:, None] + j, n).flatten()  # n: the zero row
    buf = torch.cat([xs, xs.new_zeros(1, h)]).index_select(0, src)
    got = all_to_all_single_autograd(buf, [cap] * ep, [cap] * ep, group)  # source-major blocks of cap rows
    # Source s sent its first cap rows, sorted by my local expert: the expert of its row j is the
    # number of cumulative counts <= j; rows past what it sent get ``local`` (the padding, sorted last).
    cum = recv.cumsum(1).clamp(max=cap)
    kept = torch.diff(cum, dim=1, prepend=cum.new_zeros(ep, 1)).sum(0)  # rows per local expert that arrived
    expert_of_row = torch.searchsorted(cum, j.expand(ep, cap).contiguous(), right=True).flatten()
    regroup = expert_of_row.argsort(stable=True)
    ys = experts(got.index_select(0, regroup), kept, padded=True)
    back = ys.index_select(0, inverse(regroup)).contiguous()
    ret = all_to_all_single_autograd(back, [cap] * ep, [cap] * ep, group)
    # Slot i (peer d) is row d * cap + (i - start[d]) of what came back; slots past cap: zero row.
    slot = torch.arange(n, device=dev)
    peer = torch.searchsorted(per_peer.cumsum(0), slot, right=True)
    pos = slot - start[peer]
    row = torch.where(pos < cap, peer * cap + pos, ep * cap)
    return torch.cat([ret, ret.new_zeros(1, h)]).index_select(0, row), overflow


def inverse(order: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes ``order`` (``x[order][inverse(order)] == x``)."""
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return inv
