"""Reward shaping and advantage normalisation of the RL recipes (``algorithm=``), orchestrator side.

Pure numpy, unit-tested on hand-computed groups (tests/unit/orchestrator/test_advantages.py). What the recipes
set, in the terms researchers know from verl / prime-rl / the DAPO paper:

- ``orchestrator.advantage_norm``: ``none`` (reward minus the group mean: Dr. GRPO, and this
  project's behaviour before the recipes), ``group_std`` (divided by the group's std: GRPO, DAPO),
  ``batch_std`` (divided by the std of every centred advantage of the batch: less noise from
  near-uniform groups than ``group_std``). A group whose rewards are all equal has advantage 0
  under every choice (``EPS`` in the denominator), so it changes no weight.
- ``orchestrator.overlong_buffer_frac`` / ``overlong_penalty``: DAPO's soft overlong punishment.
  With L the most tokens a sample may generate and B = frac x L the buffer, a sample of n model tokens gets
  0 for n <= L - B, ``-penalty * (n - (L - B)) / B`` inside the buffer, ``-penalty`` at L or beyond
  (the model is taught to finish before it is cut off, instead of being rewarded for truncated answers).
- ``orchestrator.dynamic_sampling``: DAPO's filter: a group with zero reward variance has zero
  advantages, so it is dropped and another drawn until the batch is full (buffer.py).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

ADVANTAGE_NORMS = ("none", "group_std", "batch_std")
"""``orchestrator.advantage_norm`` choices."""
EPS = 1e-6
"""Added to a std before dividing: a zero-variance group stays at advantage 0."""


def overlong_penalty(num_tokens: int, max_tokens: int, buffer_tokens: int, penalty: float) -> float:
    """DAPO's soft overlong punishment (<= 0) for a sample of ``num_tokens`` model tokens; 0 when
    ``buffer_tokens`` is 0 (off)."""
    if buffer_tokens <= 0 or penalty == 0:
        return 0.0
    start = max_tokens - buffer_tokens
    if num_tokens <= start:
        return 0.0
    return -penalty * min(1.0, (num_tokens - start) / buffer_tokens)


def group_scale(rewards: Sequence[float], norm: str) -> float:
    """What the group's centred advantages are multiplied by: 1 (``none``, ``batch_std``: the batch
    scale comes later) or 1 / (std + EPS) (``group_std``, the unbiased std of the group's rewards,
    as verl computes it)."""
    if norm not in ADVANTAGE_NORMS:
        raise ValueError(f"orchestrator.advantage_norm={norm!r}: choose one of {list(ADVANTAGE_NORMS)}")
    if norm != "group_std" or len(rewards) < 2:
        return 1.0
    return 1.0 / (float(np.std(np.asarray(rewards, dtype=np.float64), ddof=1)) + EPS)


def batch_scale(advantages: Sequence[float]) -> float:
    """1 / (std + EPS) of a batch's centred per-sample advantages (``batch_std``)."""
    a = np.asarray(advantages, dtype=np.float64)
    return 1.0 / (float(a.std()) + EPS) if a.size else 1.0


def zero_variance(rewards: Sequence[float], tol: float = 1e-9) -> bool:
    """Every reward of the group the same (to ``tol``): its advantages are all 0."""
    r = np.asarray(rewards, dtype=np.float64)
    return bool(r.size == 0 or np.ptp(r) <= tol)
