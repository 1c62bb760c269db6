"""Megatron-style tensor parallelism for the tiny MoE, in plain torch.distributed.

Why these pieces: TP splits every big matmul over the ranks of a TP group, and the only
communication is at the two ends of each split region (Shoeybi et al., Megatron-LM):
  - ``copy_to(x)``    "f": identity forward, all-reduce of the gradient backward
                      (each rank's slice used the same replicated input);
  - ``reduce_from(x)`` "g": all-reduce forward (sum of partial outputs), identity backward
                      (what follows is replicated, so every rank already has the gradient).
A column-parallel linear (output features split) opens a region, a row-parallel linear
(input features split) closes it: attention = f -> q/k/v column -> heads -> o row -> g;
an expert MLP = gate/up column -> down row, closed after the EP combine.

The lm_head is column-parallel over the (padded) vocabulary and never gathered:
:func:`vocab_parallel_target_logprobs` computes log p(target) and the entropy from the local
vocabulary slice with three all-reduces of ``[N]`` tensors (max, sum of exp, target logit),
as Megatron's vocab-parallel cross-entropy does; N counts only the positions that predict a
loss token (the forward's ``logits_mask``).

Every function is a no-op when the group is None (tp == 1): one code path for all degrees.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workers.models.blocks.attention import Attention
from workers.models.blocks.mlp import SwiGLU
from workers.models.blocks.norm import RMSNorm, rms_normalize

PAD_LOGIT = -1.0e4


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


def shard_linear(full: nn.Linear, dim: int, rank: int, size: int, *, pad_to: Optional[int] = None) -> nn.Linear:
    """A bias-free ``nn.Linear`` holding slice ``rank`` of ``size`` of ``full.weight`` along ``dim``.

    ``dim=0`` (output features) is column parallel, ``dim=1`` (input features) row parallel.
    ``pad_to`` first zero-pads dim 0 to that many rows (the vocabulary, so any tp divides it).
    """
    assert full.bias is None, "tiny_moe linears have no bias"
    w = full.weight.detach()
    if pad_to is not None and pad_to > w.shape[0]:
        w = torch.cat([w, w.new_zeros(pad_to - w.shape[0], w.shape[1])])
    if w.shape[dim] % size:
        raise ValueError(f"tensor parallel tp({size}) must divide {tuple(w.shape)}[{dim}] = {w.shape[dim]}")
    part = w.chunk(size, dim=dim)[rank].clone()
    out = nn.Linear(part.shape[1], part.shape[0], bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        out.weight.copy_(part)
    return out


class HeadSharedNorm(RMSNorm):
    """A per-head RMSNorm (Qwen3's q_norm / k_norm) inside a TP region: the same ``[head_dim]``
    weight on every rank, each rank applying it to its own heads only. Its gradient on a rank
    therefore covers only that rank's heads: the weight enters through ``copy_to`` so the
    backward sums it over the group (transformers' "replicated_with_grad_allreduce")."""

    def __init__(self, full: RMSNorm, group: Optional[dist.ProcessGroup]):
        nn.Module.__init__(self)
        self.weight, self.eps, self.group = full.weight, full.eps, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return copy_to(self.weight, self.group) * rms_normalize(x, self.eps)


class TensorParallelAttention(Attention):
    """Attention over this rank's ``num_heads / tp`` heads; the HF parameter names stay.

    q/k/v hold the rows of this rank's heads (head-major layout, so a contiguous slice is
    whole heads), o_proj the matching columns; Attention.forward then runs unchanged on
    the local heads and its partial output is summed over the group. Per-head q/k norms
    (Qwen3) are replicated and applied to the local heads (:class:`HeadSharedNorm`).
    """

    def __init__(self, full: Attention, group: Optional[dist.ProcessGroup], rank: int, size: int):
        nn.Module.__init__(self)
        if full.nh % size or full.nkv % size:
            raise ValueError(f"tensor parallel tp({size}) must divide num_heads({full.nh}) and num_kv_heads({full.nkv})")
        self.nh, self.hd, self.nkv, self.group = full.nh // size, full.hd, full.nkv // size, group
        self.rope_theta = full.rope_theta
        self.q_proj, self.k_proj, self.v_proj = (shard_linear(getattr(full, n), 0, rank, size)
                                                 for n in ("q_proj", "k_proj", "v_proj"))
        self.o_proj = shard_linear(full.o_proj, 1, rank, size)
        self.q_norm = None if full.q_norm is None else HeadSharedNorm(full.q_norm, group)
        self.k_norm = None if full.k_norm is None else HeadSharedNorm(full.k_norm, group)

    def forward(self, x, ctx):
        return reduce_from(super().forward(copy_to(x, self.group), ctx), self.group)


class TensorParallelMlp(nn.Module):
    """A dense layer's SwiGLU MLP (HF Llama names) split over the group: gate/up column
    parallel, down row parallel, partial outputs summed (f -> gate/up -> down -> g)."""

    def __init__(self, full: SwiGLU, group: Optional[dist.ProcessGroup], rank: int, size: int):
        super().__init__()
        self.group = group
        self.gate_proj = shard_linear(full.gate_proj, 0, rank, size)
        self.up_proj = shard_linear(full.up_proj, 0, rank, size)
        self.down_proj = shard_linear(full.down_proj, 1, rank, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to(x, self.group)
        return reduce_from(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)), self.group)


class VocabParallelHead(nn.Module):
    """lm_head with the vocabulary (zero-padded to a multiple of tp) split over the group.

    Returns LOCAL logits ``[..., padded_vocab / tp]``; padding columns hold PAD_LOGIT: no
    probability, no gradient, and finite (so p * z stays 0, where -inf would give NaN).
    """

    def __init__(self, full: nn.Linear, group: Optional[dist.ProcessGroup], rank: int, size: int):
        super().__init__()
        vocab = full.weight.shape[0]
        self.vocab_size, self.group = vocab, group
        padded = -(-vocab // size) * size
        inner = shard_linear(full, 0, rank, size, pad_to=padded)
        self.weight = inner.weight
        self.vocab_start = rank * (padded // size)
        self.num_real = max(0, min(vocab - self.vocab_start, padded // size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(copy_to(x, self.group), self.weight)
        if self.num_real < logits.shape[-1]:
            pad = torch.arange(logits.shape[-1], device=logits.device) >= self.num_real
            logits = logits.masked_fill(pad, PAD_LOGIT)
        return logits


def vocab_parallel_target_logprobs(local_logits: torch.Tensor, target: torch.Tensor, temperature: float, *,
                                   vocab_start: int, group: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and the entropy (no grad) for logits ``[..., V_local]`` and targets ``[...]``
    (any leading shape; the trainer passes the flat positions it selected: ``step.scatter_logprobs``).
    With ``group=None`` and ``vocab_start=0`` this is ``loss.token_logprobs`` on full logits.

    log p(y) = z_y - m - log sum_v exp(z_v - m) with m the global max (detached: any constant
    gives the same value and gradient); sum-exp and z_y are summed over the group with
    ``reduce_from`` so the gradient reaches each rank's slice. Full logits never exist.
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
    with torch.no_grad():  # entropy = log S + m - sum_v p_v z_v, a metric only
        pz = (e * z).sum(-1)
        if group is not None:
            dist.all_reduce(pz, group=group)
        entropy = torch.log(sum_exp) + m - pz / sum_exp
    return logp, entropy.detach()
