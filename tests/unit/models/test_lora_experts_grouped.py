"""Expert LoRA through the experts' grouped GEMMs (workers/models/lora/experts.py) against the
per-expert loop, in bfloat16 (``F.grouped_mm`` runs on the CPU too, under kernels.FAST_PATH_ON_CPU):
outputs and every adapter gradient, per_expert and shared_outer, a rank that needs padding to 8 (4)
and one that does not (8), experts with no rows included."""
from __future__ import annotations

import pytest
import torch

import workers.models.blocks.kernels as kernels
from workers.models.blocks.experts import StackedExperts
from workers.models.lora.experts import lora_experts


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("mode", ["per_expert", "shared_outer"])
@pytest.mark.parametrize("rank", [4, 8])
def test_grouped_lora_equals_the_loop(monkeypatch, mode, rank):
    torch.manual_seed(0)
    mod = lora_experts(StackedExperts(4, 32, 16), rank=rank, scale=2.0, mode=mode, dtype=torch.float32)
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0, 0.2)
    mod = mod.to(torch.bfloat16)
    rows = torch.randn(24, 32).to(torch.bfloat16)
    counts = torch.tensor([7, 0, 12, 5])  # expert 1 gets no rows
    scale = torch.rand(24)
    out, calls = {}, []
    real = torch.nn.functional.grouped_mm
    monkeypatch.setattr(torch.nn.functional, "grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    for fast in (False, True):
        monkeypatch.setattr(kernels, "FAST_PATH_ON_CPU", fast)
        mod.zero_grad(set_to_none=True)
        y = mod(rows, counts, row_scale=scale)
        y.float().square().sum().backward()
        out[fast] = (y.detach(), {n: p.grad.clone() for n, p in mod.named_parameters() if "lora" in n})
    assert mod.grouped_ok(rows) and len(calls) == 2 + (4 if mode == "per_expert" else 2)  # base 2 + LoRA
    assert _rel(out[True][0], out[False][0]) < 2e-2
    assert set(out[True][1]) == {f"lora_{ab}.{s}" for ab in "AB" for s in ("gate_up_proj", "down_proj")}
    for name, g in out[False][1].items():
        assert _rel(out[True][1][name], g) < 3e-2, name
