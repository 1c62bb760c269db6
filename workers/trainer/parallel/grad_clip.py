"""Global gradient-norm clipping over sharded gradients, with a constant number of kernels.

Why not a loop per parameter: the H200 profile of the real trainer step (1.5B MoE, ~900
parameters, benchmarks/results/gpu/raw/trainer_step_profile_2026-12-03_before_fixes.log) spent ~880 ``pow``
+ ~960 ``sum`` + ~1650 ``mul_`` launches and a float64 copy of every gradient per step on the
old per-parameter loop, part of what made the step host-bound. Here each dtype group of LOCAL
shards goes through one ``torch._foreach_norm`` (a multi-tensor kernel), the per-parameter norms
are weighted and summed on the device, one all-reduce gives the global square, and the clip is
one ``torch._foreach_mul_`` with a device-side coefficient (no branch on the host). The only
host sync is reading the returned norm, once per step.

Weights: a rank's local shard of a parameter is held by ``holders / shards`` ranks (see the
plans' ``clip_grad_norm_``), so its square counts ``shards / holders`` times; with one weight
for every parameter (the FSDP plan: disjoint slices on every rank) the weight is 1.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, Sequence

import torch

from workers.common.dtensor import local_part


@torch.no_grad()
def clip_sharded_grads_(params: Sequence[torch.nn.Parameter], max_norm: float, *,
                        weight: Callable[[torch.nn.Parameter], float] = lambda p: 1.0,
                        reduce: Callable[[torch.Tensor], object] = lambda t: t) -> float:
    """Clip the gradients of ``params`` to a global L2 norm of ``max_norm`` (inf: measure only)
    and return the global norm before clipping, as ``torch.nn.utils.clip_grad_norm_`` does.

    ``weight(p)``: how many times the square of ``p``'s local gradient counts in the global sum.
    ``reduce``: an in-place sum over the ranks whose weighted squares add up to the global square
    (identity on one rank).
    """
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return 0.0
    device = local_part(with_grad[0].grad).device
    by_kind: dict[tuple[torch.dtype, float], list[torch.Tensor]] = defaultdict(list)
    for p in with_grad:
        by_kind[(p.grad.dtype, float(weight(p)))].append(local_part(p.grad))
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for (_, w), grads in by_kind.items():
        norms = torch._foreach_norm(grads, 2.0)
        sq += torch.stack(norms).double().square().sum() * w
    reduce(sq)
    norm = sq.sqrt()
    if math.isfinite(max_norm):
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        coef = torch.where(torch.isfinite(coef), coef, torch.ones_like(coef))  # as min(1, nan) is 1
        for grads in by_kind.values():
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return float(norm)
