"""The stacked experts (workers/models/blocks/experts.py) as the mesh plan runs them on an EP rank:
the GPU path (one grouped GEMM per projection over the local experts, device-side offsets) computes
what the per-expert loop computes, forward and backward, for SwiGLU and squared-ReLU experts, with an
expert that got no rows; a narrowed module names its experts by global id in its state dict, and a
per-expert state dict round-trips through load_state_dict. Run on CPU in bfloat16
(torch.nn.functional.grouped_mm runs there too), through kernels.FAST_PATH_ON_CPU."""
from __future__ import annotations

import pytest
import torch

from workers.models.blocks import kernels
from workers.models.blocks.experts import StackedExperts, checkpoint_grads


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "row_scale"])
@pytest.mark.parametrize("gated", [True, False], ids=["swiglu", "relu2"])
def test_grouped_local_experts_match_the_loop(gated, scaled, monkeypatch):
    torch.manual_seed(0)
    experts = StackedExperts(8, 32, 16, gated=gated)
    experts.narrow_(4, 3)  # EP rank 1 of 2 with E/ep = 4... three of them: experts 4, 5, 6
    experts = experts.to(torch.bfloat16)
    names = list(experts.state_dict())
    assert names[0].startswith("4.") and names[-1].startswith("6.") and len(names) == 3 * (3 if gated else 2)
    rows = torch.randn(10, 32, dtype=torch.bfloat16, requires_grad=True)
    counts = torch.tensor([3, 0, 7])  # expert 5 got nothing
    # gate weights folded into the activation (fast path) vs scaling each expert's output (loop)
    scale = (torch.rand(10) + 0.5).requires_grad_() if scaled else None

    def run(fast: bool):
        monkeypatch.setattr(kernels, "FAST_PATH_ON_CPU", fast)
        rows.grad = None
        if scale is not None:
            scale.grad = None
        experts.zero_grad(set_to_none=False)
        y = experts(rows, counts, row_scale=scale)
        y.float().square().sum().backward()
        extra = [] if scale is None else [scale.grad.clone()]
        return y.detach(), rows.grad.clone(), [p.grad.clone() for p in experts.parameters()] + extra

    y_loop, dx_loop, dw_loop = run(False)
    y_fast, dx_fast, dw_fast = run(True)
    assert torch.allclose(y_fast.float(), y_loop.float(), atol=1e-2)
    assert torch.allclose(dx_fast.float(), dx_loop.float(), atol=1e-2)
    for a, b in zip(dw_fast, dw_loop):
        assert torch.allclose(a.float(), b.float(), atol=1e-2, rtol=2e-2)
    grads = checkpoint_grads(experts)
    assert all(float(g.abs().sum()) == 0 for n, g in grads.items() if n.startswith("5.")), "no rows: zero gradient"
    assert all(float(g.abs().sum()) > 0 for n, g in grads.items() if n.startswith("4."))


@pytest.mark.parametrize("gated", [True, False], ids=["swiglu", "relu2"])
def test_per_expert_state_dict_is_views_and_round_trips(gated):
    torch.manual_seed(0)
    a, b = StackedExperts(3, 8, 4, gated=gated), StackedExperts(3, 8, 4, gated=gated)
    state = a.state_dict()
    want = {f"{e}.{n}" for e in range(3) for n in a.per_expert_names()}
    assert set(state) == want
    assert state["1.down_proj.weight"].shape == (8, 4)
    state["1.down_proj.weight"].fill_(3.0)  # a view: writes reach the stack (the engine's loader relies on it)
    assert float(a.down_proj.detach()[1].min()) == 3.0
    b.load_state_dict(state, strict=True)
    for name in a.stacks():
        assert torch.equal(getattr(a, name), getattr(b, name))
    del state["2.up_proj.weight"]
    with pytest.raises(RuntimeError, match="2.down_proj.weight|up_proj"):
        b.load_state_dict(state, strict=True)
    state = a.state_dict()
    state["0.down_proj.weight"] = torch.zeros(8, 5)
    with pytest.raises(RuntimeError, match=r"size mismatch for 0\.down_proj\.weight.*\(8, 5\).*\(8, 4\)"):
        b.load_state_dict(state, strict=True)


def test_weight_stream_names_serves_and_flags_single_experts():
    """The publish stream of a model with stacked experts: checkpoint names in state-dict order, each
    expert served as its slice of the stack, and a NaN in one expert flagged under that expert's name."""
    from tests.integration.test_parity_parallel import CONFIGS, build_model
    from workers.trainer.weight_stream import ModelWeights

    model = build_model(CONFIGS["qwen3_moe"], 0)
    stream = ModelWeights(model)
    state = model.state_dict()
    assert stream.names == list(state)
    assert all(torch.equal(t, state[n]) for n, t in stream.items())
    assert [m.shape for m in stream.metas] == [tuple(t.shape) for t in state.values()]
    assert stream.local_nonfinite() == []
    bad = [n for n in state if ".experts.1.up_proj" in n][-1]
    with torch.no_grad():
        state[bad][0, 0] = float("nan")  # a view: the stack itself
    assert stream.local_nonfinite() == [bad]
