"""The MoE dispatch on the GPU code path at top-8 of 128 experts makes no host sync.

A device->host read (``.item()``, ``.tolist()``, ``nonzero``, ``bincount``, ``unique``, a boolean
mask index) stalls the launch queue and breaks a compiled layer. CPU tensors cannot show a stall,
so this records every aten op of a routed layer's forward and backward on the GPU code path
(``kernels.FAST_PATH_ON_CPU``, bfloat16: grouped GEMM, device-side offsets) and refuses the ops
that read values to the host or size an output by the data. Families: softmax routing (qwen3_moe)
and DeepSeek-V3's grouped sigmoid routing, each at 128 experts, top-8, with Router Replay forcing
experts (the trainer's path). Also the passes over the ``[N*k, hidden]`` slot rows (issue 36:
fewer passes over the tokens): only the gather, the un-permuting sum and the GEMMs touch them.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.unit.trainer.test_compile_graph_breaks import tiny
from workers.common.registry import MODELS
from workers.models.blocks import kernels
from workers.models.blocks.decoder import ForwardContext

HOST_READS = {"_local_scalar_dense", "nonzero", "bincount", "unique", "_unique2", "unique_consecutive",
              "masked_select", "item", "repeat_interleave"}


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def run_routed_layer(family: str, mode: TorchDispatchMode, *, replay: bool = False, **overrides):
    """Forward + backward of the first routed layer of a ``family`` model at 128 experts, top-8, in
    bfloat16 on the GPU code path, inside ``mode``: (the config, the routing record, the input's grad)."""
    base = tiny(family)
    extra = {"num_expert_groups": 8, "topk_groups": 4} if family == "deepseek_v3" else {}
    cfg = dataclasses.replace(base, num_experts=128, top_k=8, **extra, **overrides)
    kernels.FAST_PATH_ON_CPU = True
    try:
        model = MODELS.get(family).init(cfg, torch.bfloat16).train()
        layer = next(m for m in model.model.layers if getattr(m, "routed", False))
        b, t = 2, 24
        x = torch.randn(b, t, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        g = torch.Generator().manual_seed(0)
        forced = torch.rand(b, t, 128, generator=g).argsort(-1)[..., :8] if replay else None
        ctx = ForwardContext(position_ids=torch.arange(t).expand(b, t), valid=torch.ones(b, t, dtype=torch.bool),
                             mask=None, cache=None, past=0, forced_mask=None)
        ctx.forced = forced
        with mode:
            y, routing = layer(x, ctx)
            (y.float().square().mean() + routing.aux_loss).backward()
        return cfg, routing, x.grad
    finally:
        kernels.FAST_PATH_ON_CPU = False


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("replay", [False, True])
def test_top8_of_128_dispatch_reads_nothing_to_the_host(family, replay):
    ops = Ops()
    _cfg, routing, grad = run_routed_layer(family, ops, replay=replay)
    bad = sorted({n for n in ops.names if n in HOST_READS})
    assert not bad, bad
    assert "_grouped_mm" in ops.names or "grouped_mm" in ops.names  # the grouped GEMM path did run
    assert routing.experts.shape[-1] == 8 and grad is not None


class RowPasses(TorchDispatchMode):
    """Counts the aten ops whose output has the slot rows' shape ``[N*k, hidden]``."""

    def __init__(self, shape: tuple[int, int]):
        super().__init__()
        self.shape, self.names = shape, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(first, torch.Tensor) and tuple(first.shape) == self.shape:
            self.names.append(func.overloadpacket.__name__)
        return out


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_top8_dispatch_passes_over_slot_rows(family):
    """Forward + backward of a routed layer touch the ``[N*k, H]`` slot rows only in the gather and
    its backward, the un-permuting sum and its backward (index_select each) and two grouped GEMMs
    (the down projection's output, the gate/up projection's input gradient): the gate weights scale
    the ``[N*k, I]`` activation (StackedExperts row_scale), with no elementwise pass of their own
    over hidden-wide rows in either direction (three ``mul`` passes before)."""
    passes = RowPasses((2 * 24 * 8, tiny(family).hidden_size))
    run_routed_layer(family, passes, expert_intermediate_size=40)
    assert sorted(passes.names) == ["_grouped_mm"] * 2 + ["index_select"] * 4, passes.names
