"""The sigmoid top-k router of DeepSeek-V3 / Kimi-K2 / GLM-5 / Nemotron-H MoE layers.

Scores are ``sigmoid(x W^T)`` in float32. The choice adds ``e_score_correction_bias`` (the
aux-loss-free balancing bias: it steers which experts are chosen, never the gate weights),
keeps the ``topk_group`` best of ``n_group`` expert groups (a group scores the sum of its two
best experts), then the top_k experts among those. Gate weights are the chosen experts' plain
scores, renormalised to sum 1 when ``norm_topk_prob``, times ``routed_scaling_factor``.

Router Replay: ``forced`` replaces the choice; weights still come from this model's scores, so
the router's gradient flows. Parameter names are the checkpoints' (``gate.weight``,
``gate.e_score_correction_bias``). :meth:`SigmoidTopkRouter.update_bias` is the balancing rule
(DeepSeek-V3 report, sec. 2.1.2): raise the bias of under-loaded experts by ``rate``, lower the
over-loaded ones, from the load counted over a step.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class SigmoidTopkRouter(nn.Module):
    def __init__(self, *, hidden_size: int, num_experts: int, top_k: int, n_group: int = 1, topk_group: int = 1,
                 norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0):
        super().__init__()
        if num_experts % n_group or topk_group > n_group or top_k > (num_experts // n_group) * topk_group:
            raise ValueError(f"router: num_experts({num_experts}) must split into n_group({n_group}) groups, "
                             f"topk_group({topk_group}) <= n_group, and top_k({top_k}) <= experts in the kept groups")
        self.num_experts, self.top_k = num_experts, top_k
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts), persistent=True)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """[N, E] float32 sigmoid scores of flat tokens x [N, H]."""
        return F.linear(x.float(), self.weight.float()).sigmoid()

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """[N, k] experts: biased scores, best groups first (no gradient: a choice, not a weight)."""
        biased = scores.detach() + self.e_score_correction_bias.float()
        if self.n_group > 1:
            n = biased.shape[0]
            per_group = biased.view(n, self.n_group, -1)
            group_score = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(-1)  # [N, G]
            keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(
                1, group_score.topk(self.topk_group, dim=-1).indices, True)
            biased = biased.masked_fill(~keep[:, :, None].expand_as(per_group).reshape(n, -1), float("-inf"))
        return biased.topk(self.top_k, dim=-1).indices

    def route(self, x: torch.Tensor, forced: Optional[torch.Tensor] = None,
              forced_mask: Optional[torch.Tensor] = None):
        """(indices [N,k] int64, gate weights [N,k] float32, probs [N,E] for balance statistics)."""
        scores = self.scores(x)
        idx = self.choose(scores)
        if forced is not None:
            forced = forced.long()
            idx = forced if forced_mask is None else torch.where(forced_mask.bool()[:, None], forced, idx)
        weights = scores.gather(-1, idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        probs = scores / scores.sum(-1, keepdim=True).clamp_min(1e-20)
        return idx, weights * self.routed_scaling_factor, probs

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float) -> None:
        """Aux-loss-free balancing: bias += rate * sign(mean load - load), ``load`` [E] counted over a step."""
        load = load.float()
        self.e_score_correction_bias.add_(rate * torch.sign(load.mean() - load))
