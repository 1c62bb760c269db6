"""The RL objective's knobs beside the importance-sampled policy gradient (workers/trainer/loss.py):
loss aggregation, PPO clipping against the behaviour policy, the KL penalty to a reference policy.

Pure tensor functions (unit-tested on hand-computed batches: tests/unit/trainer/test_objective.py). What the
recipes (``algorithm=``, hydra_conf/algorithm/) set, in the terms researchers know from verl /
prime-rl:

- **aggregation** (``trainer.loss_agg``): how per-token terms become one scalar. ``token_mean``
  divides the step's token sum by its loss-token count (every token weighs the same, so long
  answers weigh more: DAPO); ``seq_mean_token_mean`` averages each sequence's tokens first, then
  the sequences (every answer weighs the same: GRPO as published, GSPO); ``seq_mean_token_sum``
  sums each sequence's tokens and averages the sequences (no length normalisation: Dr. GRPO).
  Data parallelism is kept exact by passing GLOBAL normalisers, as for the loss itself: each
  mode is a per-token weight (1, or 1 / the row's loss tokens) and a count summed over ranks.
- **clipping** (``trainer.clip_low`` / ``clip_high``): PPO's ``min(r A, clip(r) A)`` has zero
  gradient exactly where the clipped branch is taken (A > 0 and r > 1 + high, or A < 0 and
  r < 1 - low); elsewhere its gradient is ``r A grad log p``, the truncated-IS gradient loss.py
  already computes. So clipping is a mask on top of the staleness corrections (ratio cap and
  mask band), and the ratio is the one ``trainer.ratio_level`` picks (GSPO: the sequence's
  geometric mean).
- **KL to a reference** (``trainer.kl_coef``, ``kl_estimator``): Schulman's estimators of
  KL(pi || pi_ref) from the sampled token's log-probs, with gradient through pi.
"""
from __future__ import annotations

import torch


def aggregation(loss_mask: torch.Tensor, mode: str) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(token_weight [B, T] or None, this rank's normaliser)`` for ``trainer.loss_agg``.

    The loss is ``sum_t weight_t * term_t / N`` with N the normaliser summed over the ranks:
    ``token_mean``: weight 1, N = loss tokens; ``seq_mean_token_sum``: weight 1, N = rows with a
    loss token; ``seq_mean_token_mean``: weight 1 / (the row's loss tokens), N = rows. Computed on
    WHOLE rows (before micro-batches or context-parallel chunks narrow the loss mask).
    """
    mask = loss_mask.bool()
    if mode == "token_mean":
        return None, mask.sum().to(torch.float64)
    per_row = mask.sum(1)
    rows = (per_row > 0).sum().to(torch.float64)
    if mode == "seq_mean_token_sum":
        return None, rows
    if mode == "seq_mean_token_mean":
        weight = (1.0 / per_row.clamp_min(1).to(torch.float32))[:, None].expand_as(mask)
        return torch.where(mask, weight, torch.zeros_like(weight)), rows
    raise ValueError(f"trainer.loss_agg={mode!r}: choose token_mean | seq_mean_token_sum | seq_mean_token_mean")


def clipped(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float) -> torch.Tensor:
    """``[B, T]`` bool: tokens where PPO's clipped branch is taken (no gradient). ``ratio`` is the
    ``[B, T]`` ratio against the behaviour policy at the chosen level, ``advantages`` ``[B, T]``;
    a bound of 0 is off."""
    out = torch.zeros_like(ratio, dtype=torch.bool)
    if clip_high > 0:
        out |= (advantages > 0) & (ratio > 1.0 + clip_high)
    if clip_low > 0:
        out |= (advantages < 0) & (ratio < 1.0 - clip_low)
    return out


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) on tokens sampled from pi, ``[B, T]``, gradient through ``logp``.

    With log r = logp - ref_logp: ``k1`` = log r (unbiased, high variance, can be negative);
    ``k2`` = (log r)^2 / 2; ``k3`` = exp(-log r) - 1 + log r (unbiased, non-negative). The log-ratio
    is clamped to +-20 so a token the reference finds impossible stays finite.
    """
    log_r = (logp - ref_logp).clamp(-20.0, 20.0)
    if estimator == "k1":
        return log_r
    if estimator == "k2":
        return 0.5 * log_r ** 2
    if estimator == "k3":
        return torch.expm1(-log_r) + log_r
    raise ValueError(f"trainer.kl_estimator={estimator!r}: choose k1 | k2 | k3")
