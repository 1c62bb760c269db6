"""The softmax top-k routed Mixture-of-Experts MLP (Qwen3-MoE, tiny_moe): router, experts, balance
loss, and the grouped-GEMM fast path (no host sync) next to the per-expert reference loop.

Routing: ``probs = softmax(x W_gate^T)`` in float32, the top_k experts by probability; the gate
weights are those experts' probabilities, renormalised to sum 1 when ``norm_topk_prob`` (tiny_moe,
Qwen3-30B-A3B) or used raw when it is off (transformers' Qwen3MoeConfig default). Gate weights
always come from this model's router, also when Router Replay forces the experts (``forced``),
so router gradients flow. The experts are stacked parameters (workers/models/blocks/experts.py)
whose ``state_dict()`` keeps HF Qwen3-MoE checkpoint names (``mlp.gate.weight``,
``mlp.experts.E.gate_proj.weight``); the trainer's expert-parallel block
(workers/trainer/parallel/expert.py) subclasses MoeBlock and reuses ``route`` and ``balance``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.blocks import kernels
from workers.models.blocks.experts import StackedExperts


class _GatherSlots(torch.autograd.Function):
    """``x[tok_of]`` (each token once per routed slot, grouped by expert). Backward gathers by
    the inverse permutation and sums each token's k slots: no atomic index_add."""

    @staticmethod
    def forward(ctx, x, tok_of, inv, k):
        ctx.save_for_backward(inv)
        ctx.k = k
        return x.index_select(0, tok_of)

    @staticmethod
    def backward(ctx, g):
        (inv,) = ctx.saved_tensors
        return g.index_select(0, inv).view(inv.numel() // ctx.k, ctx.k, -1).sum(1), None, None, None


class _UnpermuteSum(torch.autograd.Function):
    """``out[t] = sum of y over token t's k slots`` (y in expert order); backward is a gather."""

    @staticmethod
    def forward(ctx, y, tok_of, inv, k):
        ctx.save_for_backward(tok_of)
        return y.index_select(0, inv).view(inv.numel() // k, k, -1).sum(1)

    @staticmethod
    def backward(ctx, g):
        (tok_of,) = ctx.saved_tensors
        return g.index_select(0, tok_of), None, None, None


class MoeBlock(nn.Module):
    """Softmax top-k router + experts. Gate weights always come from this model's router."""

    def __init__(self, *, hidden_size: int, num_experts: int, top_k: int, expert_intermediate_size: int,
                 norm_topk_prob: bool = True):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = StackedExperts(num_experts, hidden_size, expert_intermediate_size)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, E]`` logits of flat tokens (a subclass with another router module overrides it)."""
        return self.gate(x)

    def route(self, x: torch.Tensor, forced: Optional[torch.Tensor], forced_mask: Optional[torch.Tensor] = None):
        """Returns (indices [N,k], weights [N,k], probs [N,E]) for flat tokens x [N,H].

        ``forced`` [N,k] replaces the top-k choice (Router Replay); where ``forced_mask``
        [N] is False the router's own top-k is kept (tokens inference did not report).
        """
        probs = F.softmax(self.router_logits(x).float(), dim=-1)
        idx = probs.topk(self.top_k, dim=-1).indices
        if forced is not None:
            forced = forced.long()
            idx = forced if forced_mask is None else torch.where(forced_mask.bool()[:, None], forced, idx)
        weights = probs.gather(-1, idx)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-9)
        return idx, weights, probs

    def forward(self, x: torch.Tensor, forced: Optional[torch.Tensor], valid: Optional[torch.Tensor],
                forced_mask: Optional[torch.Tensor] = None):
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        idx, weights, probs = self.route(flat, None if forced is None else forced.reshape(-1, self.top_k),
                                         None if forced_mask is None else forced_mask.reshape(-1))
        out = self.routed_experts(flat, idx, weights)
        aux, frac = self.balance(idx, probs, valid)
        return out.view(b, t, h), idx.view(b, t, self.top_k), aux, frac

    def decode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, idx)`` of :meth:`forward` for an engine's decode step: no balance loss or load (a
        dozen small kernels per layer and step that only the trainer reads), no Router Replay."""
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        idx, weights, _ = self.route(flat, None)
        return self.routed_experts(flat, idx, weights).view(b, t, h), idx.view(b, t, self.top_k)

    def routed_experts(self, flat: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_k weights[:, k] * expert_{idx[:, k]}(flat): grouped GEMM on the fast path, else the loop.
        Under the trainer's expert-parallel plan an :class:`ExpertParallel` object set as
        ``expert_parallel`` (workers/trainer/parallel/expert.py) runs it instead (all-to-all dispatch)."""
        ep = getattr(self, "expert_parallel", None)  # set in __dict__ by the mesh plan; getattr: dynamo traces it
        if ep is not None:
            return ep(flat, idx, weights)
        if kernels.fast(flat) and self.experts.grouped_ok(flat):
            return self._experts_grouped(flat, idx, weights)
        if flat.is_cuda and torch.cuda.is_current_stream_capturing():  # the static engine's CUDA graphs
            return self._experts_dense(flat, idx, weights)
        return self._experts_loop(flat, idx, weights)

    def balance(self, idx: torch.Tensor, probs: torch.Tensor, valid: Optional[torch.Tensor]):
        """Switch-Transformer balance loss over valid tokens, E * sum_e f_e * P_e, and f [E].

        Separate so the trainer's expert-parallel block (same routing, experts on other
        ranks) returns the very same loss and load.
        """
        vmask = torch.ones(idx.shape[0], device=idx.device) if valid is None else valid.reshape(-1).float()
        n = vmask.sum().clamp_min(1.0)
        if kernels.fast(idx):  # the same counts without one_hot's host sync (it checks the index range)
            onehot = torch.zeros(idx.shape[0], self.num_experts, device=idx.device).scatter_add_(
                1, idx, torch.ones(idx.shape, device=idx.device))
        else:
            onehot = F.one_hot(idx, self.num_experts).float().sum(1)  # [N, E]
        frac = (onehot * vmask[:, None]).sum(0) / (n * self.top_k)
        mean_prob = (probs * vmask[:, None]).sum(0) / n
        aux = self.num_experts * (frac.detach() * mean_prob).sum()
        return aux, frac.detach()

    def _experts_loop(self, flat: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Reference: one index_select / matmul / index_add per expert (host sync per expert)."""
        out = torch.zeros_like(flat)
        for e in range(self.num_experts):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            y = self.experts.expert(e, flat.index_select(0, rows))
            out.index_add_(0, rows, y * weights[rows, slot, None].to(y.dtype))
        return out

    def _experts_dense(self, flat: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, scaled by its gate weight (0 where not chosen): no
        data-dependent shapes, so a CUDA graph can capture it where grouped GEMM does not apply
        (float32). E times the expert FLOPs: for tiny models and tests, not for serving. Sums in
        float32 (Nemotron-H's LatentMoE reuses it, whose reference sums its experts in float32)."""
        gate = torch.zeros(flat.shape[0], self.num_experts, dtype=weights.dtype, device=flat.device)
        gate.scatter_add_(1, idx, weights)
        out = torch.zeros(flat.shape, dtype=torch.float32, device=flat.device)
        for e in range(self.num_experts):
            out = out + (self.experts.expert(e, flat) * gate[:, e:e + 1]).float()
        return out.to(flat.dtype)

    def _experts_grouped(self, flat: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sort token slots by expert, two grouped GEMMs over all experts (the stacked parameters,
        workers/models/blocks/experts.py), no host sync.

        Same function as the loop up to rounding: each token's k expert outputs are summed in one
        reduction (fp32 accumulate) instead of k bf16 index_adds, and the gate weight scales the
        activation before the down projection rather than its output. Passes over the ``[N*k, H]``
        slot rows: the gather, the two GEMMs' reads and writes, the un-permuting sum.
        """
        k = self.top_k
        expert_ids = idx.reshape(-1)  # [N*k], slot s belongs to token s // k
        # sorted as int16 (expert ids < 2^15): a radix sort makes one pass per key byte, and int64 keys
        # cost a decode layer ~28 us on an H100 (the largest of its small kernels after the attention)
        keys = expert_ids.to(torch.int16) if self.num_experts <= 32767 else expert_ids
        order = keys.argsort(stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
            0, expert_ids, torch.ones_like(expert_ids))  # bincount would sync to size its output
        tok_of = order // k
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        xs = _GatherSlots.apply(flat, tok_of, inv, k)  # [N*k, H] grouped by expert
        # gate weights folded into the experts' activation (StackedExperts.forward's row_scale):
        # no [N*k, H] pass to scale the outputs, nor one over them in the backward
        y = self.experts(xs, counts, row_scale=weights.reshape(-1).index_select(0, order))
        return _UnpermuteSum.apply(y, tok_of, inv, k)
