"""Router Replay (R3), trainer side: what to force, at which positions, and the load it causes.

The mismatch R3 removes: inference (bf16, other kernels) and the trainer (fp32) compute
slightly different router scores; wherever the top-k flips, the two evaluate a different
function of the input and the importance ratio of every later token pays for it. Replay
makes the trainer use inference's expert SET per (token, layer) while the gate WEIGHTS
still come from the trainer's own router (``MoeBlock.route``), so the router keeps
learning and the gradient is that of the function inference sampled from.

Position convention (workers/common/protocol.py): ``routed_experts[b, t]`` are the experts
used when token t was the model's INPUT, i.e. those that produced the distribution of
token t+1. SGLang reports positions ``[routed_experts_start_len, seqlen - 1)``: the last
sampled token is never fed, so it has none. Positions without a report carry
``routed_mask = 0`` and are never guessed at: with ``replay_unreported=recompute`` the
trainer routes them itself, with ``mask`` every loss token they predict leaves the loss.

Multi-turn episodes (workers/orchestrator/episodes.py): each turn's call reports rows from
0; the orchestrator keeps the rows earlier turns reported (what their logprobs saw) and
appends only the new ones, so a sample has exactly ``len(tokens) - 1`` rows and the
observation tokens' rows are the engine's own. Prompt tokens served from a prefix cache
that an engine does not report arrive with ``routed_mask = 0`` and are recomputed (or
masked, see above). batch.py refuses routing on pad positions; a replay that is off by a
position shows as a ``routing_disagreement`` far above the few percent that numerics flip
(the loop warns past MISALIGNED_DISAGREEMENT), not as silence.
"""
from __future__ import annotations

from typing import Optional

import torch

#: Under replay, a per-layer disagreement above this means the replayed rows do not belong
#: to the tokens they sit on (numerics alone flip a few percent of slots, not most).
MISALIGNED_DISAGREEMENT = 0.5


def replay_inputs(routed_experts: Optional[torch.Tensor], routed_mask: Optional[torch.Tensor], *,
                  enabled: bool) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(forced_experts, forced_mask)`` for the model forward (None, None: route freely)."""
    if not enabled or routed_experts is None:
        return None, None
    return routed_experts, routed_mask


def mask_unreported(loss_mask: torch.Tensor, routed_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """``loss_mask`` without the tokens predicted from an unreported position (t from t-1)."""
    if routed_mask is None:
        return loss_mask
    reported_prev = torch.cat([torch.zeros_like(routed_mask[:, :1]), routed_mask[:, :-1]], dim=1)
    return loss_mask & reported_prev.bool()


def expert_load_metrics(counts: torch.Tensor) -> dict[str, float]:
    """Per-layer load of the routed slots ``counts [L, E]`` (global, all ranks).

    ``expert_load_max_l{i}`` = E * (busiest expert's share): 1.0 is perfect balance, E means
    one expert took every slot; under EP the busiest expert's rank sets the layer's pace.
    ``expert_load_min_l{i}`` likewise for the idlest (0: an expert got nothing, a dead expert
    in the making). ``expert_load_max`` is the worst layer.
    """
    counts = counts.double()
    share = counts / counts.sum(-1, keepdim=True).clamp_min(1.0)
    num_experts = counts.shape[-1]
    out: dict[str, float] = {}
    for i, row in enumerate(share):
        out[f"expert_load_max_l{i}"] = float(row.max() * num_experts)
        out[f"expert_load_min_l{i}"] = float(row.min() * num_experts)
    if len(share):  # a dense model (no MoE layer) has no load to report
        out["expert_load_max"] = max(out[f"expert_load_max_l{i}"] for i in range(len(share)))
    return out
