"""clip_sharded_grads_ (workers/trainer/parallel/grad_clip.py) against torch's clip_grad_norm_ on one rank."""
import copy

import pytest
import torch

from workers.trainer.parallel.grad_clip import clip_sharded_grads_


def _model_with_grads(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3, bias=False), torch.nn.Linear(3, 2))
    m(torch.randn(4, 7)).square().sum().backward()
    m[2].bias.grad = None  # a parameter without a gradient is skipped, as torch does
    return m


@pytest.mark.parametrize("max_norm", [0.05, 1e6, float("inf")])
def test_same_norm_and_clipped_grads_as_torch(max_norm):
    ours, ref = _model_with_grads(), _model_with_grads()
    norm = clip_sharded_grads_(list(ours.parameters()), max_norm)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    assert norm == pytest.approx(float(ref_norm), rel=1e-6)
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)


def test_weights_count_squares_and_reduce_sees_the_local_sum():
    m = _model_with_grads()
    plain = clip_sharded_grads_(list(m.parameters()), float("inf"))
    seen = []
    doubled = clip_sharded_grads_(list(m.parameters()), float("inf"), weight=lambda p: 2.0,
                                  reduce=lambda t: seen.append(float(t)))
    assert doubled == pytest.approx(plain * 2 ** 0.5, rel=1e-9)
    assert seen == [pytest.approx(2 * plain ** 2, rel=1e-9)]


def test_a_nonfinite_norm_leaves_the_gradients_as_they_are():
    m = _model_with_grads()
    m[0].weight.grad[0, 0] = float("nan")
    before = copy.deepcopy([p.grad for p in m.parameters()])
    norm = clip_sharded_grads_(list(m.parameters()), 0.01)
    assert norm != norm  # nan is reported
    for g, b in zip([p.grad for p in m.parameters()], before):
        if g is not None:
            torch.testing.assert_close(g, b, equal_nan=True)
