"""Graph breaks of a compiled decoder layer (trainer.compile=layers, workers/trainer/compile.py).

Each break splits a layer into separately compiled pieces with a host round trip between them:
the launch-bound step (benchmarks/results/README.md, "GPU") is what compiling is meant to fix. On the GPU code path
(``kernels.FAST_PATH_ON_CPU`` with bfloat16: grouped-GEMM experts, no per-expert loop) the
qwen3_moe and deepseek_v3 layers compile to ONE graph each, with Router Replay forcing experts
and the trainer's routing capture wrapped around every router. A ``.item()``, ``.tolist()`` or a
Python branch on a tensor value added to a layer's forward makes this test fail. The CPU
reference path keeps its per-expert ``nonzero`` loop (data-dependent shapes: a break per
expert batch), bounded here too so it does not get worse unnoticed.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml

from workers.common.registry import MODELS
from workers.models.blocks import kernels
from workers.trainer.routing_capture import capture_routing

ROOT = Path(__file__).resolve().parents[3]


def tiny(family: str):
    raw = yaml.safe_load((ROOT / "hydra_conf" / "model" / f"{family}_tiny.yaml").read_text())
    raw.pop("defaults")
    return MODELS.get(family).config(**raw)


def layer_breaks(family: str, *, fast: bool) -> list[tuple[str, int, int]]:
    """``(layer class, graphs, breaks)`` of every layer's forward, traced by dynamo's explain with
    the inputs the training forward gives it (replayed routing, captured routers)."""
    cfg = tiny(family)
    dtype = torch.bfloat16 if fast else torch.float32
    model = MODELS.get(family).build(cfg, device="cpu", dtype=dtype).train()
    calls = []
    for layer in model.model.layers:
        def record(x, ctx, _layer=layer):
            calls.append((_layer, x.detach().requires_grad_(), copy.copy(ctx)))
            return type(_layer).forward(_layer, x, ctx)
        layer.forward = record
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=g)
    forced = torch.rand(2, 12, cfg.num_routed_layers, cfg.num_experts, generator=g).argsort(-1)[..., :cfg.top_k]
    valid = torch.ones(2, 12, dtype=torch.bool)
    with capture_routing(model, valid=valid):
        model(ids, attention_mask=valid, forced_experts=forced)
        out = []
        for layer, x, ctx in calls:
            torch._dynamo.reset()
            e = torch._dynamo.explain(type(layer).forward)(layer, x, ctx)
            out.append((type(layer).__name__, e.graph_count, e.graph_break_count))
    return out


@pytest.fixture
def gpu_code_path():
    kernels.FAST_PATH_ON_CPU = True
    yield
    kernels.FAST_PATH_ON_CPU = False


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_layers_compile_to_one_graph_on_the_gpu_code_path(family, gpu_code_path):
    got = layer_breaks(family, fast=True)
    assert len(got) == tiny(family).num_layers
    assert all(breaks == 0 and graphs == 1 for _, graphs, breaks in got), got


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_cpu_reference_path_breaks_only_in_the_expert_loop(family):
    """Dense layers: no break; MoE layers: the reference loop's nonzero (at most one per expert)."""
    cfg = tiny(family)
    got = layer_breaks(family, fast=False)
    assert got[0][2] == 0, got  # layer 0 is dense in both tiny presets
    assert all(breaks <= cfg.num_experts for _, _, breaks in got), got
