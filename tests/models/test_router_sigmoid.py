"""The sigmoid grouped top-k router against transformers' DeepseekV3TopkRouter (same weights and bias)."""
from __future__ import annotations

import pytest
import torch

from workers.models.blocks.router_sigmoid import SigmoidTopkRouter

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("n_group,topk_group,norm", [(1, 1, True), (4, 2, True), (4, 2, False), (2, 1, True)])
def test_router_matches_deepseek_v3(n_group, topk_group, norm):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=n_group,
                           topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5)
    torch.manual_seed(0)
    ref = DeepseekV3TopkRouter(cfg)
    torch.nn.init.normal_(ref.weight, std=0.5)
    ref.e_score_correction_bias.copy_(torch.randn(16) * 0.3)
    ours = SigmoidTopkRouter(hidden_size=32, num_experts=16, top_k=4, n_group=n_group, topk_group=topk_group,
                             norm_topk_prob=norm, routed_scaling_factor=2.5)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(64, 32)
    _, want_w, want_i = ref(x)
    idx, w, _ = ours.route(x)
    order_ref, order_ours = want_i.sort(-1), idx.sort(-1)
    assert torch.equal(order_ref.values, order_ours.values)
    torch.testing.assert_close(w.gather(-1, order_ours.indices), want_w.gather(-1, order_ref.indices))


def test_forced_experts_keep_gate_weights_from_scores_and_gradients_flow():
    r = SigmoidTopkRouter(hidden_size=8, num_experts=8, top_k=2)
    torch.nn.init.normal_(r.weight)
    x = torch.randn(5, 8)
    forced = torch.tensor([[0, 1]] * 5)
    idx, w, _ = r.route(x, forced)
    assert torch.equal(idx, forced)
    s = r.scores(x)[:, :2]
    torch.testing.assert_close(w, s / s.sum(-1, keepdim=True))
    (w * torch.arange(10.0).view(5, 2)).sum().backward()
    assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0


def test_bias_update_raises_underloaded_and_lowers_overloaded():
    r = SigmoidTopkRouter(hidden_size=4, num_experts=4, top_k=1)
    r.update_bias(torch.tensor([10.0, 0.0, 5.0, 5.0]), rate=0.01)
    assert r.e_score_correction_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0])


def test_bad_grouping_is_refused_with_numbers():
    with pytest.raises(ValueError, match=r"num_experts\(10\).*n_group\(4\)"):
        SigmoidTopkRouter(hidden_size=4, num_experts=10, top_k=2, n_group=4, topk_group=2)
