"""The recipe knobs of the trainer's loss on hand-computed batches (workers/trainer/objective.py, loss.py):
loss aggregation, PPO clip_low / clip_high against the behaviour policy (with the staleness cap and
mask still applied), the entropy bonus (its gradient through the vocabulary), KL estimators. CPU, < 2 s."""
from __future__ import annotations

import math

import pytest
import torch

from workers.trainer.loss import policy_loss
from workers.trainer.objective import aggregation, clipped, kl_estimate
from workers.trainer.parallel.tensor import vocab_parallel_target_logprobs

torch.set_num_threads(1)
KW = dict(ratio_cap=2.0, ratio_mask_low=0.2, ratio_mask_high=5.0)
# two rows: row 0 has 3 loss tokens (positions 1-3), row 1 has 1 (position 1)
MASK = torch.tensor([[False, True, True, True, False], [False, True, False, False, False]])
ADV = torch.tensor([1.0, -2.0])


def grad_of(mode: str, logp_inf=None, adv=ADV, **kw) -> torch.Tensor:
    weight, norm = aggregation(MASK, mode)
    lp = torch.zeros(2, 5, requires_grad=True)
    inf = torch.zeros(2, 5) if logp_inf is None else logp_inf
    loss, _ = policy_loss(lp, inf, adv, MASK, num_loss_tokens=float(norm), token_weight=weight, **{**KW, **kw})
    loss.backward()
    return lp.grad


@pytest.mark.parametrize("mode,row0,row1", [
    ("token_mean", -1 / 4, 2 / 4),           # every token / 4 tokens
    ("seq_mean_token_sum", -1 / 2, 2 / 2),   # each row's token sum / 2 rows
    ("seq_mean_token_mean", -1 / 6, 2 / 2),  # each row's token mean (1/3, 1/1) / 2 rows
])
def test_loss_aggregation_weights_tokens_as_documented(mode, row0, row1):
    """ratio 1 everywhere: d loss / d logp_t = -A_row * weight_t / N."""
    g = grad_of(mode)
    expect = torch.zeros(2, 5)
    expect[0, 1:4] = row0
    expect[1, 1] = row1
    assert torch.allclose(g, expect, atol=1e-7), (mode, g)


def test_aggregation_normalisers_are_sums_so_shards_add_up():
    """Each rank's normaliser is its own count: rows 0 and 1 on two ranks sum to the one-rank value."""
    for mode in ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean"):
        _, full = aggregation(MASK, mode)
        parts = sum(float(aggregation(MASK[i:i + 1], mode)[1]) for i in range(2))
        assert parts == float(full)
    with pytest.raises(ValueError, match="trainer.loss_agg"):
        aggregation(MASK, "sum")


def test_ppo_clip_against_behaviour_policy_with_cap_and_mask():
    """Row 0 (A=+1): ratios e^0.3, e^0.1, e^-0.5; row 1 (A=-1): e^-0.3 (pos 1). Extra row 2 (A=-1):
    e^0.9 (2.46: unclipped since A<0, its IS weight capped at 2) and e^1.8 (6.05: masked, > 5)."""
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 0], [0, 1, 1, 0]], dtype=torch.bool)
    inf = -torch.tensor([[0, 0.3, 0.1, -0.5], [0, -0.3, 0, 0], [0, 0.9, 1.8, 0]])
    adv = torch.tensor([1.0, -1.0, -1.0])
    lp = torch.zeros(3, 4, requires_grad=True)
    loss, st = policy_loss(lp, inf, adv, mask, num_loss_tokens=6.0, clip_low=0.2, clip_high=0.28, **KW)
    loss.backward()
    # clipped: (0,1) r=1.35 > 1.28 with A>0; (1,1) r=0.74 < 0.8 with A<0. Masked: (2,2).
    # kept: (0,2) w=e^0.1, (0,3) w=e^-0.5 (A>0, r<1: PPO keeps it), (2,1) w=min(e^0.9, 2)=2
    expect = torch.zeros(3, 4)
    expect[0, 2], expect[0, 3], expect[2, 1] = -math.exp(0.1) / 6, -math.exp(-0.5) / 6, 2.0 / 6
    assert torch.allclose(lp.grad, expect, atol=1e-6), lp.grad
    assert (st.num_clipped, st.num_masked, st.num_capped) == (2, 1, 1)
    # a symmetric 0.2 clip takes the same two; no clip (0, 0) gives (0,1) and (1,1) their gradient back
    assert clipped(torch.exp(-inf), adv[:, None].expand(3, 4), 0.2, 0.2).logical_and(mask).sum() == 2
    lp.grad = None
    loss, st = policy_loss(lp, inf, adv, mask, num_loss_tokens=6.0, **KW)
    loss.backward()
    assert st.num_clipped == 0
    assert lp.grad[0, 1] == pytest.approx(-math.exp(0.3) / 6) and lp.grad[1, 1] == pytest.approx(math.exp(-0.3) / 6)


def test_clip_at_sequence_level_gspo():
    """ratio_level=geometric: the row's geometric-mean ratio is clipped as a whole (GSPO)."""
    mask = torch.tensor([[0, 1, 1]], dtype=torch.bool)
    inf = -torch.tensor([[0, 0.002, 0.0]])  # geometric mean ratio e^0.001 = 1.001 > 1 + 4e-4
    lp = torch.zeros(1, 3, requires_grad=True)
    loss, st = policy_loss(lp, inf, torch.tensor([1.0]), mask, num_loss_tokens=1.0, ratio_level="geometric",
                           clip_low=3e-4, clip_high=4e-4, **KW)
    assert st.num_clipped == 2 and loss.requires_grad
    loss.backward()
    assert torch.count_nonzero(lp.grad) == 0
    _, st = policy_loss(lp, inf, torch.tensor([-1.0]), mask, num_loss_tokens=1.0, ratio_level="geometric",
                        clip_low=3e-4, clip_high=4e-4, **KW)
    assert st.num_clipped == 0  # A < 0 and r > 1: PPO keeps it


def test_entropy_bonus_gradient():
    """loss -= c * sum_kept(H_t * weight_t) / N: d loss / d H_t = -c / N on kept tokens only."""
    mask = torch.tensor([[0, 1, 1, 1]], dtype=torch.bool)
    inf = torch.tensor([[0, 0.0, 0.0, -5.0]])  # last token's ratio e^5: masked
    lp = torch.zeros(1, 4)
    ent = torch.tensor([[0, 0.5, 0.7, 0.9]], requires_grad=True)
    loss, st = policy_loss(lp, inf, torch.tensor([0.0]), mask, num_loss_tokens=3.0, entropy=ent, entropy_coef=0.01,
                           **KW)
    assert loss.item() == pytest.approx(-0.01 * (0.5 + 0.7) / 3)
    loss.backward()
    assert torch.allclose(ent.grad, torch.tensor([[0, -0.01 / 3, -0.01 / 3, 0]]))
    assert st.entropy_sum == pytest.approx(2.1)


def test_entropy_with_gradient_matches_autograd_of_the_full_softmax():
    """entropy_grad=True: the trainer's vocab-parallel formula differentiates like -(p log p).sum()."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(4, 7, generator=g, requires_grad=True)
    y = torch.randint(0, 7, (4,), generator=g)
    _, h = vocab_parallel_target_logprobs(z, y, 0.8, vocab_start=0, group=None, entropy_grad=True)
    (h * torch.arange(1.0, 5.0)).sum().backward()
    got = z.grad.clone()
    z.grad = None
    logp = torch.log_softmax(z / 0.8, -1)
    ref = -(logp.exp() * logp).sum(-1)
    assert torch.allclose(h, ref, atol=1e-6)
    (ref * torch.arange(1.0, 5.0)).sum().backward()
    assert torch.allclose(got, z.grad, atol=1e-6)
    _, h0 = vocab_parallel_target_logprobs(z, y, 0.8, vocab_start=0, group=None)
    assert not h0.requires_grad  # the default: a metric only


def test_kl_estimators_values_and_gradients():
    lp = torch.tensor([0.5], requires_grad=True)
    ref = torch.tensor([0.0])
    values = {e: kl_estimate(lp, ref, e) for e in ("k1", "k2", "k3")}
    assert values["k1"].item() == pytest.approx(0.5)
    assert values["k2"].item() == pytest.approx(0.125)
    assert values["k3"].item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    values["k3"].backward()
    assert lp.grad.item() == pytest.approx(1 - math.exp(-0.5))
    assert kl_estimate(torch.tensor([-1.0]), torch.tensor([-1.0]), "k3").item() == 0.0
    with pytest.raises(ValueError, match="trainer.kl_estimator"):
        kl_estimate(lp, ref, "k4")


def test_kl_penalty_in_the_loss():
    """kl_coef * sum_kept(k) / N is added; its statistic is reported whatever the coefficient."""
    mask = torch.tensor([[0, 1, 1]], dtype=torch.bool)
    lp = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[0.0, -1.5, -2.0]])
    loss, st = policy_loss(lp, lp.detach(), torch.tensor([0.0]), mask, num_loss_tokens=2.0, ref_logprobs=ref,
                           kl_coef=0.1, kl_estimator="k2", **KW)
    assert loss.item() == pytest.approx(0.1 * 0.125 / 2)
    assert st.ref_kl_sum == pytest.approx(0.125)
    loss.backward()
    assert lp.grad[0, 1].item() == pytest.approx(0.1 * 0.5 / 2)
