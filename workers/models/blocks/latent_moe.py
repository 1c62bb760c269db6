"""Nemotron-H's MoE layer: sigmoid top-k router, non-gated squared-ReLU experts, a shared expert
and LatentMoE (``moe_latent_size``), plus the dense squared-ReLU MLP those experts are made of.

LatentMoE (Nemotron 3 Super/Ultra): the router and the shared expert see the full hidden state;
the routed path projects tokens down to the latent width (``fc1_latent_proj``), runs the experts
there (their ``up_proj`` is ``[I, latent]``) and projects the weighted sum back up
(``fc2_latent_proj``). Without a latent size the experts work on the hidden width directly.
Order and names follow transformers' NemotronHMoE (checkpoint names
``mixer.gate.weight``, ``mixer.experts.E.up_proj.weight``, ``mixer.shared_experts.down_proj.weight``,
``mixer.fc1_latent_proj.weight`` ...), so a checkpoint loads as is; the routed experts are stacked
parameters (workers/models/blocks/experts.py, non-gated) whose state dict has those per-expert names.

Router Replay: ``forced`` experts replace the router's choice; gate weights still come from this
model's scores (workers/models/blocks/router_sigmoid.py). The balance statistics are tiny_moe's
Switch-Transformer loss over the router's normalised scores (the reference has no aux loss; the
trainer weighs it, 0 turns it off).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.blocks import kernels
from workers.models.blocks.experts import StackedExperts
from workers.models.blocks.router_sigmoid import SigmoidTopkRouter
from workers.models.blocks.moe_softmax import MoeBlock


class ReluSquaredMLP(nn.Module):
    """``down(relu(up(x))^2)``: Nemotron-H's dense MLP layers, experts and shared experts."""

    def __init__(self, dim: int, inter: int, bias: bool = False):
        super().__init__()
        self.up_proj = nn.Linear(dim, inter, bias=bias)
        self.down_proj = nn.Linear(inter, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())


class LatentMoE(nn.Module):
    # tiny_moe's routed-layer machinery, reading num_experts, top_k and experts: the balance loss and
    # load, the capture-safe dense expert sum, and the grouped-GEMM path over the stacked experts.
    balance = MoeBlock.balance
    _experts_dense, _experts_grouped = MoeBlock._experts_dense, MoeBlock._experts_grouped

    def __init__(self, *, hidden_size: int, num_experts: int, top_k: int, expert_intermediate_size: int,
                 shared_intermediate_size: int, latent_size: int = 0, n_group: int = 1, topk_group: int = 1,
                 norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        width = latent_size or hidden_size
        self.gate = SigmoidTopkRouter(hidden_size=hidden_size, num_experts=num_experts, top_k=top_k, n_group=n_group,
                                      topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                                      routed_scaling_factor=routed_scaling_factor)
        self.experts = StackedExperts(num_experts, width, expert_intermediate_size, gated=False)
        self.shared_experts = ReluSquaredMLP(hidden_size, shared_intermediate_size)
        if latent_size:
            self.fc1_latent_proj = nn.Linear(hidden_size, latent_size, bias=False)
            self.fc2_latent_proj = nn.Linear(latent_size, hidden_size, bias=False)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None

    def forward(self, x: torch.Tensor, forced: Optional[torch.Tensor] = None, valid: Optional[torch.Tensor] = None,
                forced_mask: Optional[torch.Tensor] = None):
        """``x`` [B, T, H] -> (out [B, T, H], experts [B, T, k], aux loss, load [E])."""
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        idx, weights, probs = self.gate.route(flat, None if forced is None else forced.reshape(-1, self.top_k),
                                              None if forced_mask is None else forced_mask.reshape(-1))
        routed = flat if self.fc1_latent_proj is None else self.fc1_latent_proj(flat)
        routed = self.routed_experts(routed, idx, weights)
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        out = routed.view(b, t, h) + self.shared_experts(x)
        aux, load = self.balance(idx, probs, valid)
        return out, idx.view(b, t, self.top_k), aux, load

    def routed_experts(self, flat: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts on the (latent) tokens: the trainer's expert-parallel plan sets
        ``expert_parallel`` (workers/trainer/parallel/expert.py), else the reference loop."""
        ep = getattr(self, "expert_parallel", None)  # set in __dict__ by the mesh plan; getattr: dynamo traces it
        return ep(flat, idx, weights) if ep is not None else self._experts(flat, idx, weights)

    def _experts(self, flat: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Reference loop: each expert on its tokens, weighted, summed in float32 (as the reference).
        bf16 on the fast path: sorted by expert, two grouped GEMMs, no host sync (MoeBlock's). Else
        under CUDA-graph capture (the static engine's decode graphs, float32) the loop's
        data-dependent shapes cannot be recorded: every expert runs on every token (E x the FLOPs)."""
        if kernels.fast(flat) and self.experts.grouped_ok(flat):
            return self._experts_grouped(flat, idx, weights)
        if flat.is_cuda and torch.cuda.is_current_stream_capturing():
            return self._experts_dense(flat, idx, weights)
        out = torch.zeros(flat.shape, dtype=torch.float32, device=flat.device)
        for e in range(self.num_experts):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            y = self.experts.expert(e, flat.index_select(0, rows))
            out.index_add_(0, rows, (y * weights[rows, slot, None]).float())
        return out.to(flat.dtype)
