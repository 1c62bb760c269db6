"""Packed rows inside a compiled layer (trainer.compile=layers): document boundaries are tensors
(workers/models/blocks/varlen.py), so attention over packed rows neither breaks the layer's graph
nor recompiles when the packing layout changes. Checked with dynamo's counters on the GPU code
path (``kernels.FAST_PATH_ON_CPU``, bfloat16) with the aot_eager backend: two batches of the same
shape packed differently compile once, with no graph break, and give what the eager layer gives."""
from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from tests.unit.trainer.test_compile_graph_breaks import tiny
from workers.common.registry import MODELS
from workers.models.blocks import kernels
from workers.trainer.compile import apply_compile
from workers.trainer.packing import plan_packing

torch.set_num_threads(1)


def layouts(cfg, seed):
    """Two packed batches of the same [P, L] shape whose documents differ in number and lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for lengths in ([5, 9, 3, 7], [12, 2, 6, 3]):  # 4 runs, longest 9; 5 runs (one padding), longest 12
        attention = torch.zeros(4, 12, dtype=torch.bool)
        for r, n in enumerate(lengths):
            attention[r, :n] = True
        p = plan_packing(attention)
        ids = p.pack(torch.randint(0, cfg.vocab_size, (4, 12), generator=g))
        out.append((ids, p.attention_mask, p.position_ids, p.segment_ids))
    assert out[0][3].shape == out[1][3].shape and not torch.equal(out[0][3], out[1][3])
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_packed_rows_compile_once_without_graph_breaks(family):
    kernels.FAST_PATH_ON_CPU = True
    try:
        cfg = tiny(family)
        model = MODELS.get(family).init(cfg, torch.bfloat16).train()  # seeded weights (build leaves them uninitialised)
        batches = layouts(cfg, 0)
        with torch.no_grad():
            eager = [model(ids, attention_mask=a, position_ids=pos, segment_ids=seg).logits
                     for ids, a, pos, seg in batches]
        compiled = copy.deepcopy(model)
        torch._dynamo.reset()
        counters.clear()
        apply_compile(compiled.model.layers[:1], "layers", backend="aot_eager")  # the dense layer 0
        apply_compile(compiled.model.layers[1:2], "layers", backend="aot_eager")  # an MoE layer
        for (ids, a, pos, seg), want in zip(batches, eager):
            got = compiled(ids, attention_mask=a, position_ids=pos, segment_ids=seg).logits
            torch.testing.assert_close(got.detach(), want, rtol=3e-2, atol=3e-2)
        breaks = sum(counters["graph_break"].values())
        frames = counters["stats"]["unique_graphs"]
        assert breaks == 0, dict(counters["graph_break"])
        assert frames == 2, dict(counters["stats"])  # one graph per compiled layer, none per layout
    finally:
        kernels.FAST_PATH_ON_CPU = False
        torch._dynamo.reset()
