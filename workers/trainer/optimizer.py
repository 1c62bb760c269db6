"""AdamW that steps the LOCAL shards of sharded parameters, with torch's own AdamW arithmetic.

Why: under FSDP2 / DTensor every parameter, gradient and moment is a DTensor, and
``torch.optim.AdamW`` sends its foreach or fused ops through DTensor's dispatcher, which
propagates shardings over every argument of the list each call: host time that grows with the
number of parameters, on a MoE of several hundred parameters enough to make the fused kernel
slower than foreach (benchmarks/results/gpu/mesh_step.json records the step with this optimizer).
AdamW is elementwise, so each rank can update its own shards as plain tensors: the same
``torch.optim.adam.adam`` functional (decoupled weight decay = AdamW), fused on CUDA, on
``to_local()`` views that share storage with the DTensors.

The state is AdamW's own (``step``, ``exp_avg``, ``exp_avg_sq`` per parameter, moments as
DTensors shaped like their parameter), so ``torch.distributed.checkpoint``'s optimizer state
dict, resharding on load (workers/trainer/dcp_state.py) and a plain ``torch.optim.AdamW``
reading it back all see the usual layout.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch.optim.adam import adam

from workers.common.dtensor import local_part


class ShardLocalAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW(params, ...)`` whose step runs on local shards; ``fused`` as AdamW's
    (None: torch's default choice for the device)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], **kwargs):
        super().__init__(params, **kwargs)
        for group in self.param_groups:
            if group.get("amsgrad") or group.get("maximize") or group.get("capturable") or group.get("differentiable"):
                raise ValueError("ShardLocalAdamW implements plain AdamW only (no amsgrad / maximize / "
                                 "capturable / differentiable)")

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "ShardLocalAdamW.step takes no closure"
        for group in self.param_groups:
            fused = bool(group.get("fused"))
            params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # AdamW's own initial state (a device step tensor when fused, as AdamW makes it)
                    device = local_part(p).device if fused else torch.device("cpu")
                    state["step"] = torch.zeros((), dtype=torch.float32, device=device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(local_part(p))
                grads.append(local_part(p.grad))
                exp_avgs.append(local_part(state["exp_avg"]))
                exp_avg_sqs.append(local_part(state["exp_avg_sq"]))
                steps.append(state["step"])
            if not params:
                continue
            beta1, beta2 = group["betas"]
            adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=group.get("foreach"), fused=fused or None,
                 decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                 weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
        return None
