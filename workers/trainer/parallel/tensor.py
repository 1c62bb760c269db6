"""Tensor-parallel pieces the DTensor plan (workers/trainer/parallel/mesh.py) needs beside
``parallelize_module``, in plain torch.distributed.

Why these: DTensor's ColwiseParallel / RowwiseParallel handle the ends of every split matmul, but a
tensor that every head shares and that is used OUTSIDE a DTensor region gets a partial gradient
on each TP rank (only its own heads contribute), which must be summed over the group:
  - ``copy_to(x)`` (Megatron's "f"): identity forward, all-reduce of the gradient backward; used
    for MLA's shared rope key and, through :class:`HeadSharedNorm`, Qwen3's per-head q/k norms;
  - ``reduce_from(x)`` ("g"): all-reduce forward, identity backward (the vocab-parallel sums).

The lm_head's logits stay vocab-sharded: :func:`vocab_parallel_target_logprobs` computes log
p(target) and the entropy from the local vocabulary slice with three all-reduces of ``[N]``
tensors (max, sum of exp, target logit), as Megatron's vocab-parallel cross-entropy does; N counts
only the positions that predict a loss token (the forward's ``logits_mask``).

Every function is a no-op when the group is None (tp == 1): one code path for all degrees.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn



class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Enter a TP region (Megatron's f)."""
    return x if group is None else _CopyTo.apply(x, group)


def reduce_from(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Leave a TP region: sum the partial results of the ranks (Megatron's g)."""
    return x if group is None else _ReduceFrom.apply(x, group)


class HeadSharedNorm(nn.Module):
    """A per-head norm (Qwen3's RMSNorm or Gemma 3's ``(1 + w)`` q_norm / k_norm) inside a TP region:
    the same ``[head_dim]`` weight on every rank, each rank applying it to its own heads only. Its
    gradient on a rank therefore covers only that rank's heads: the weight enters through ``copy_to``
    so the backward sums it over the group (transformers' "replicated_with_grad_allreduce"). The
    formula is the wrapped norm's own (its ``scaled(x, weight)``, workers/models/blocks/norm.py);
    the parameter keeps its name (``q_norm.weight``)."""

    def __init__(self, full: nn.Module, group: Optional[dist.ProcessGroup]):
        super().__init__()
        self.weight, self.eps, self.group = full.weight, full.eps, group
        self.__dict__["norm_kind"] = type(full)  # not a submodule: its weight is this module's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_kind.scaled(self, x, copy_to(self.weight, self.group))


def vocab_parallel_target_logprobs(local_logits: torch.Tensor, target: torch.Tensor, temperature: float, *,
                                   vocab_start: int, group: Optional[dist.ProcessGroup],
                                   entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and the entropy (no grad) for logits ``[..., V_local]`` and targets ``[...]``
    (any leading shape; the trainer passes the flat positions it selected: ``step.scatter_logprobs``).
    With ``group=None`` and ``vocab_start=0`` this is ``loss.token_logprobs`` on full logits.

    log p(y) = z_y - m - log sum_v exp(z_v - m) with m the global max (detached: any constant
    gives the same value and gradient); sum-exp and z_y are summed over the group with
    ``reduce_from`` so the gradient reaches each rank's slice. Full logits never exist.
    ``entropy_grad``: the entropy keeps its gradient too (trainer.entropy_coef > 0: an entropy bonus).
    """
    assert temperature > 0, f"temperature must be > 0, got {temperature}"
    work = torch.promote_types(local_logits.dtype, torch.float32)
    z = local_logits.to(work) / temperature  # [..., V_local]
    target = target - vocab_start
    mine = (target >= 0) & (target < z.shape[-1])
    m = z.detach().max(-1).values
    if group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(z - m[..., None])
    sum_exp = reduce_from(e.sum(-1), group)
    z_y = z.gather(-1, target.clamp(0, z.shape[-1] - 1)[..., None]).squeeze(-1)
    z_y = reduce_from(torch.where(mine, z_y, torch.zeros_like(z_y)), group)
    logp = z_y - m - torch.log(sum_exp)
    if entropy_grad:  # the same formula with its gradient (m is a constant: it cancels)
        return logp, torch.log(sum_exp) + m - reduce_from((e * z).sum(-1), group) / sum_exp
    with torch.no_grad():  # entropy = log S + m - sum_v p_v z_v, a metric only
        pz = (e * z).sum(-1)
        if group is not None:
            dist.all_reduce(pz, group=group)
        entropy = torch.log(sum_exp) + m - pz / sum_exp
    return logp, entropy.detach()
