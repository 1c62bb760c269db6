"""The MoE MLP of DeepSeek-V3 / Kimi-K2 / GLM-5: sigmoid grouped top-k router, routed experts,
always-on shared experts.

Built on the softmax MoeBlock (workers/models/blocks/moe_softmax.py) so the expert compute is the same
code: the per-expert reference loop on CPU, the grouped-GEMM path on GPU, Switch balance
statistics; only the router differs (workers/models/blocks/router_sigmoid.py, whose gate weights
are scores times ``routed_scaling_factor``), and the shared experts' output is added. Names are
the checkpoints': ``gate.weight``, ``gate.e_score_correction_bias``, ``experts.E.{gate,up,down}_proj``,
``shared_experts.{gate,up,down}_proj`` (one SwiGLU ``num_shared_experts`` experts wide, as the
checkpoints store it).

The balance loss returned is the Switch statistic over the router's normalised scores; DeepSeek-V3
balances with the correction bias instead (``SigmoidTopkRouter.update_bias``), so a trainer
that follows it weighs this loss 0.
"""
from __future__ import annotations

from typing import Optional

import torch

from workers.models.blocks.router_sigmoid import SigmoidTopkRouter
from workers.models.blocks.mlp import Expert
from workers.models.blocks.moe_softmax import MoeBlock


class SigmoidMoe(MoeBlock):
    """``cfg`` needs hidden_size, num_experts, top_k, expert_intermediate_size, num_shared_experts,
    num_expert_groups, topk_groups, norm_topk_prob, routed_scaling_factor."""

    def __init__(self, cfg):
        super().__init__(hidden_size=cfg.hidden_size, num_experts=cfg.num_experts, top_k=cfg.top_k,
                         expert_intermediate_size=cfg.expert_intermediate_size)  # the experts and their compute paths
        self.gate = SigmoidTopkRouter(hidden_size=cfg.hidden_size, num_experts=cfg.num_experts, top_k=cfg.top_k,
                                      n_group=cfg.num_expert_groups, topk_group=cfg.topk_groups,
                                      norm_topk_prob=cfg.norm_topk_prob,
                                      routed_scaling_factor=cfg.routed_scaling_factor)
        self.shared_experts = Expert(cfg.hidden_size, cfg.expert_intermediate_size * cfg.num_shared_experts)

    def route(self, x: torch.Tensor, forced: Optional[torch.Tensor], forced_mask: Optional[torch.Tensor] = None):
        return self.gate.route(x, forced, forced_mask)

    def forward(self, x: torch.Tensor, forced: Optional[torch.Tensor], valid: Optional[torch.Tensor],
                forced_mask: Optional[torch.Tensor] = None):
        routed, idx, aux, load = super().forward(x, forced, valid, forced_mask)
        return routed + self.shared_experts(x), idx, aux, load
