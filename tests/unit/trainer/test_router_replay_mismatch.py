"""Mismatch handling in the loss: importance ratios at token, sequence and geometric level
(truncation at ratio_cap, masking outside [ratio_mask_low, ratio_mask_high]), and the k3
mismatch KL that stays per token whatever the level."""
from __future__ import annotations

import math

import pytest
import torch

from workers.common.config import TrainerConfig
from workers.trainer.loss import policy_loss

CAP, LOW, HIGH = 2.0, 0.2, 5.0


def run(log_ratios: list[list[float]], level: str):
    """Rows of loss tokens at positions 1.. with the given log(pi_train / pi_inference)."""
    b, t = len(log_ratios), max(len(r) for r in log_ratios) + 1
    mask = torch.zeros(b, t, dtype=torch.bool)
    lr = torch.zeros(b, t)
    for i, row in enumerate(log_ratios):
        mask[i, 1:1 + len(row)] = True
        lr[i, 1:1 + len(row)] = torch.tensor(row)
    logp_inf = torch.full((b, t), -1.0) * mask
    logp = (logp_inf + lr).requires_grad_(True)
    loss, stats = policy_loss(logp, logp_inf, torch.ones(b), mask, num_loss_tokens=float(mask.sum()), ratio_cap=CAP,
                              ratio_mask_low=LOW, ratio_mask_high=HIGH, ratio_level=level)
    loss.backward()
    # d loss / d logp = -weight * A / N on kept tokens: recover the weights the level applied
    weights = (-logp.grad * float(mask.sum()))[mask].view(-1).tolist()
    return weights, stats


ROWS = [[0.1, 0.1, 0.1], [1.0, 1.0, -0.5], [-2.0, 0.0, 0.0]]


def test_token_level_caps_and_masks_each_token():
    w, st = run(ROWS, "token")
    want = [math.exp(0.1)] * 3 + [CAP, CAP, math.exp(-0.5)] + [0.0, 1.0, 1.0]  # exp(-2) < 0.2: masked
    assert w == pytest.approx(want, rel=1e-5)
    assert (st.num_masked, st.num_capped) == (1, 2)


def test_sequence_level_uses_the_product_per_row():
    w, st = run(ROWS, "sequence")
    # rows: exp(0.3) kept; exp(1.5) = 4.48 kept but capped at 2; exp(-2) masked as a whole row
    assert w == pytest.approx([math.exp(0.3)] * 3 + [CAP] * 3 + [0.0] * 3, rel=1e-5)
    assert (st.num_masked, st.num_capped) == (3, 3)


def test_geometric_level_is_length_normalised():
    w, st = run(ROWS, "geometric")
    assert w == pytest.approx([math.exp(0.1)] * 3 + [math.exp(0.5)] * 3 + [math.exp(-2 / 3)] * 3, rel=1e-5)
    assert (st.num_masked, st.num_capped) == (0, 0)


def test_k3_and_ratio_statistics_stay_per_token():
    flat = [x for row in ROWS for x in row]
    k3 = sum(math.exp(x) - x - 1 for x in flat)
    for level in ("token", "sequence", "geometric"):
        _, st = run(ROWS, level)
        assert st.k3_sum == pytest.approx(k3, rel=1e-6)
        assert st.ratio_max == pytest.approx(math.exp(1.0), rel=1e-6)


def test_unknown_levels_are_refused_in_the_config():
    with pytest.raises(ValueError, match=r"trainer.ratio_level='row' is not supported; choose one of \['token'"):
        TrainerConfig(ratio_level="row")
    with pytest.raises(ValueError, match=r"trainer.replay_unreported='guess'"):
        TrainerConfig(replay_unreported="guess")
