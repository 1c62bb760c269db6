"""The mesh plan's local experts (workers/trainer/expert_parallel.py): the GPU path (one grouped GEMM
per projection over the local experts, device-side offsets) computes what the per-expert loop
computes, forward and backward, for SwiGLU and squared-ReLU experts, with an expert that got no
rows; parameter names stay the HF ones keyed by global expert id. Run on CPU in bfloat16
(torch.nn.functional.grouped_mm runs there too), through kernels.FAST_PATH_ON_CPU."""
from __future__ import annotations

import pytest
import torch

from workers.models.blocks import kernels
from workers.models.blocks.latent_moe import ReluSquaredMLP
from workers.models.blocks.mlp import Expert
from workers.trainer.expert_parallel import LocalExperts


@pytest.mark.parametrize("make", [lambda: Expert(32, 16), lambda: ReluSquaredMLP(32, 16)], ids=["swiglu", "relu2"])
def test_grouped_local_experts_match_the_loop(make, monkeypatch):
    torch.manual_seed(0)
    experts = LocalExperts({str(i): make() for i in (4, 5, 6)}).to(torch.bfloat16)
    assert [n for n, _ in experts.named_parameters()][0].startswith("4."), "global expert ids"
    rows = torch.randn(10, 32, dtype=torch.bfloat16, requires_grad=True)
    counts = torch.tensor([3, 0, 7])  # expert 5 got nothing

    def run(fast: bool):
        monkeypatch.setattr(kernels, "FAST_PATH_ON_CPU", fast)
        rows.grad = None
        experts.zero_grad(set_to_none=False)
        y = experts(rows, counts)
        y.float().square().sum().backward()
        return y.detach(), rows.grad.clone(), [p.grad.clone() for p in experts.parameters()]

    y_loop, dx_loop, dw_loop = run(False)
    y_fast, dx_fast, dw_fast = run(True)
    assert torch.allclose(y_fast.float(), y_loop.float(), atol=1e-2)
    assert torch.allclose(dx_fast.float(), dx_loop.float(), atol=1e-2)
    for a, b in zip(dw_fast, dw_loop):
        assert torch.allclose(a.float(), b.float(), atol=1e-2)
    assert all(float(p.grad.abs().sum()) == 0 for p in experts["5"].parameters()), "no rows: zero gradient"
