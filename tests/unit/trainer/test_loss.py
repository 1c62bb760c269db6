"""Unit tests of workers.trainer.loss: ratio masking/capping, k3, global normalisation,
the DP-exact balance loss, log-prob alignment, routing disagreement. CPU, < 2 s."""
from __future__ import annotations

import math

import pytest
import torch

from workers.models.tiny_moe.model import TinyMoeConfig, build_model
from workers.trainer.loss import (load_balance_loss, loss_relevant_inputs, own_topk, policy_loss, router_stats,
                                  routing_disagreement, token_logprobs)

torch.set_num_threads(1)
KW = dict(ratio_cap=2.0, ratio_mask_low=0.2, ratio_mask_high=5.0)


def _batch(seed=0, b=6, t=8):
    g = torch.Generator().manual_seed(seed)
    logp_inf = -torch.rand(b, t, generator=g) * 3
    logp_train = (logp_inf + 0.3 * torch.randn(b, t, generator=g)).requires_grad_()
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[:, 0] = False
    adv = torch.randn(b, generator=g)
    return logp_train, logp_inf, adv, mask


def test_k3_is_zero_when_logprobs_match_and_positive_otherwise():
    logp, _, adv, mask = _batch()
    same = logp.detach().clone()
    _, st = policy_loss(logp, same, adv, mask, num_loss_tokens=int(mask.sum()), **KW)
    assert st.k3_sum == pytest.approx(0.0, abs=1e-6)
    assert st.ratio_sum / st.num_tokens == pytest.approx(1.0, abs=1e-6)
    assert st.num_masked == 0 and st.num_capped == 0
    _, st = policy_loss(logp, same + 0.1 * torch.randn(same.shape), adv, mask, num_loss_tokens=int(mask.sum()), **KW)
    assert st.k3_sum > 0


def test_ratio_masking_and_capping():
    lp = torch.full((1, 6), -1.0, requires_grad=True)
    # ratios exp(lp - inf): t1 -> e^-2 (~0.14, masked low), t2 -> e^2 (~7.4, masked high),
    # t3 -> e^1 (~2.7, capped to 2), t4 -> 1, t5 outside loss_mask (ignored despite ratio).
    inf = torch.tensor([[0.0, 1.0, -3.0, -2.0, -1.0, 5.0]])
    mask = torch.tensor([[False, True, True, True, True, False]])
    adv = torch.tensor([1.0])
    loss, st = policy_loss(lp, inf, adv, mask, num_loss_tokens=10, **KW)
    assert (st.num_tokens, st.num_masked, st.num_capped) == (4, 2, 1)
    assert st.ratio_max == pytest.approx(math.e ** 2, rel=1e-5)
    assert st.ratio_min == pytest.approx(math.e ** -2, rel=1e-5)
    loss.backward()
    # d loss / d logp_t = -w_t * A / N for kept tokens, 0 for masked ones (w detached).
    expect = torch.tensor([[0.0, 0.0, 0.0, -2.0 / 10, -1.0 / 10, 0.0]])
    assert torch.allclose(lp.grad, expect, atol=1e-6)
    assert loss.item() == pytest.approx(-(2.0 * -1.0 + 1.0 * -1.0) / 10, rel=1e-6)


def test_normalised_by_global_tokens_so_shard_gradients_sum_to_full():
    logp, inf, adv, mask = _batch(seed=3, b=7)
    n_global = int(mask.sum())
    full, _ = policy_loss(logp, inf, adv, mask, num_loss_tokens=n_global, **KW)
    (g_full,) = torch.autograd.grad(full, logp)
    # Unequal shards (rows 0::2 has 4 rows, 1::2 has 3): a local-count normaliser would not sum up.
    g_sum = torch.zeros_like(logp)
    loss_sum = 0.0
    for r in range(2):
        rows = torch.arange(r, 7, 2)
        part = logp.detach()[rows].clone().requires_grad_()
        loss, _ = policy_loss(part, inf[rows], adv[rows], mask[rows], num_loss_tokens=n_global, **KW)
        (g,) = torch.autograd.grad(loss, part)
        g_sum[rows] += g
        loss_sum += loss.item()
    assert torch.allclose(g_sum, g_full, atol=1e-7)
    assert loss_sum == pytest.approx(full.item(), rel=1e-6)
    # and the wrong normaliser really differs here (guards the test itself)
    local = [int(mask[torch.arange(r, 7, 2)].sum()) for r in range(2)]
    assert local[0] * 2 != n_global


def test_masked_tokens_keep_the_global_denominator():
    lp = torch.zeros(1, 3, requires_grad=True)
    inf = torch.tensor([[0.0, 0.0, 5.0]])  # last token ratio e^-5: masked
    mask = torch.tensor([[False, True, True]])
    loss, st = policy_loss(lp - 1.0, inf - 1.0, torch.tensor([1.0]), mask, num_loss_tokens=2, **KW)
    loss.backward()
    assert st.num_masked == 1
    assert lp.grad.tolist() == [[0.0, -0.5, 0.0]]


def test_token_logprobs_shift_and_temperature():
    logits = torch.randn(2, 5, 7)
    ids = torch.randint(0, 7, (2, 5))
    logp, ent = token_logprobs(logits, ids, temperature=0.5)
    ref = torch.log_softmax(logits / 0.5, -1)
    assert logp[:, 0].abs().max() == 0
    for t in range(1, 5):
        assert torch.allclose(logp[:, t], ref[:, t - 1].gather(-1, ids[:, t, None]).squeeze(-1), atol=1e-6)
    p = ref.exp()
    assert torch.allclose(ent[:, 1:], -(p * ref).sum(-1)[:, :-1], atol=1e-5)
    # bf16 logits are scored in float32
    lp16, _ = token_logprobs(logits.bfloat16(), ids, 1.0)
    assert lp16.dtype == torch.float32


def _tiny():
    cfg = TinyMoeConfig(vocab_size=16, hidden_size=32, num_layers=2, num_heads=2, num_experts=4, top_k=2,
                        expert_intermediate_size=32)
    return build_model(cfg, seed=7)


def _forward_with_gates(model, ids, mask, **kw):
    gates = []
    hooks = [l.mlp.gate.register_forward_hook(lambda _m, _i, o: gates.append(o)) for l in model.model.layers]
    try:
        out = model(ids, attention_mask=mask, **kw)
    finally:
        for h in hooks:
            h.remove()
    return out, gates


def test_balance_loss_matches_model_and_is_dp_exact():
    torch.manual_seed(0)
    model = _tiny()
    ids = torch.randint(0, 16, (6, 9))
    valid = torch.ones(6, 9, dtype=torch.bool)
    valid[1, 6:] = False
    valid[4, 3:] = False
    out, gates = _forward_with_gates(model, ids, valid)
    prob_sums, counts = router_stats(gates, out.routed_experts, valid, 4)
    one_rank = load_balance_loss(prob_sums, counts, float(valid.sum()), top_k=2)
    assert one_rank.item() == pytest.approx(out.aux_loss.item(), rel=1e-5)
    # two shards with global counts: values and gradients add up to the one-rank loss
    shards = [torch.arange(r, 6, 2) for r in range(2)]
    parts = []
    for rows in shards:
        o, g = _forward_with_gates(model, ids[rows], valid[rows])
        parts.append(router_stats(g, o.routed_experts, valid[rows], 4))
    counts_g = sum(c for _, c in parts)
    assert torch.equal(counts_g, counts)
    total = sum(load_balance_loss(p, counts_g, float(valid.sum()), top_k=2) for p, _ in parts)
    assert total.item() == pytest.approx(one_rank.item(), rel=1e-5)
    gate_w = model.model.layers[0].mlp.gate.weight
    (g_one,) = torch.autograd.grad(one_rank, gate_w, retain_graph=True)
    (g_dp,) = torch.autograd.grad(total, gate_w)
    assert torch.allclose(g_one, g_dp, atol=1e-7, rtol=1e-5)


def test_routing_disagreement_compares_sets_on_selected_slots():
    own = torch.tensor([[[[0, 1]], [[2, 3]], [[1, 2]]]])  # [B=1, T=3, L=1, k=2]
    ref = torch.tensor([[[[1, 0]], [[2, 0]], [[0, 0]]]])  # same set, differs, differs (unselected)
    slots = torch.tensor([[True, True, False]])
    assert routing_disagreement(own, ref, slots) == (1.0, 2.0)
    lm = torch.tensor([[False, False, True, True]])
    assert loss_relevant_inputs(lm).tolist() == [[False, True, True, False]]


def test_own_topk_matches_unforced_routing_and_replay_forces():
    model = _tiny()
    ids = torch.randint(0, 16, (3, 6))
    out, gates = _forward_with_gates(model, ids, None)
    assert torch.equal(own_topk(gates, 2, (3, 6)), out.routed_experts)
    forced = (out.routed_experts + 1) % 4
    out2, gates2 = _forward_with_gates(model, ids, None, forced_experts=forced)
    assert torch.equal(out2.routed_experts, forced)
    b, t = ids.shape
    dis, n = routing_disagreement(own_topk(gates2, 2, (b, t)), forced, torch.ones(b, t, dtype=torch.bool))
    assert n == b * t * 2 and dis > 0


def test_router_counts_equal_the_one_hot_definition_without_building_it():
    """prob_stats counts by scatter-add (issue 20: no [B, T, L, k, E] tensor); same numbers as one-hot."""
    import torch.nn.functional as F

    from workers.trainer.loss import prob_stats

    gen = torch.Generator().manual_seed(0)
    b, t, layers, k, e = 3, 7, 2, 3, 8
    routed = torch.randint(0, e, (b, t, layers, k), generator=gen)
    valid = torch.rand(b, t, generator=gen) > 0.3
    probs = [torch.rand(b * t, e, generator=gen) for _ in range(layers)]
    _, counts = prob_stats(probs, routed, valid, e)
    want = (F.one_hot(routed, e).float().sum(3) * valid.float()[:, :, None, None]).sum((0, 1))
    assert torch.equal(counts, want) and counts.sum() == valid.sum() * layers * k
