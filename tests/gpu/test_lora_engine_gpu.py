"""LoRA adapters on the static engine's CUDA-graph decode path (issue 44 item 3) on a GPU.

Skipped without CUDA (CI has none). The adapter buffers are allocated before the first capture and
only written in place, and each row's adapter id is read from a persistent per-slot buffer inside the
captured step, so graphs captured with one adapter must serve the next one without a new capture.
bfloat16 (grouped-GEMM experts and grouped-GEMM expert adapters): a running graph engine that switches
adapters gives bit for bit what an eager static engine gives with the new adapter, with no graph
captured for the switch; two adapters and the base in one batch. float32: graph greedy tokens equal
the merged model's no-cache reference.
"""
from __future__ import annotations

import copy

import pytest
import torch

from benchmarks.gpu.common import TINY_MOE, init_on_device
from tests.gpu.test_static_engine_gpu import PROMPTS, _run, _static
from tests.unit.inference.test_engine_lora import merged, random_adapter
from workers.inference.embedded.engine import GenRequest
from workers.inference.embedded.lora import EngineLora

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "experts")


def _greedy(n=16, adapter=None):
    return [GenRequest(rid=str(i), input_ids=p, temperature=0.0, max_new_tokens=n - i, adapter=adapter(i) if adapter
                       else None) for i, p in enumerate(PROMPTS[:8])]


def _on(ad, device, dtype):
    ad.tensors = {k: (a.to(device, dtype), b.to(device, dtype)) for k, (a, b) in ad.tensors.items()}
    return ad


@needs_cuda
def test_adapter_switch_reuses_captured_graphs_bfloat16():
    dev, dt = torch.device("cuda"), torch.bfloat16
    model = init_on_device(TINY_MOE, dev, dt, seed=0).eval()
    lora = EngineLora(model, rank=8, targets=TARGETS, num_adapters=2, names=["a", "b"])
    ads = [_on(random_adapter(lora, 8, seed=s, alpha=4.0), dev, dt) for s in (1, 2, 3)]
    lora.load(ads[0], slot=0)
    lora.load(ads[1], slot=1)
    mix = lambda i: ("a", "b", "base")[i % 3]  # noqa: E731
    engine = _static(model, lora=lora).start()
    try:
        before = engine.generate(_greedy(adapter=mix), timeout_s=300)
        keys = set(engine._graphs.graphs)
        with engine._model_lock:
            lora.load(ads[2], slot=0)  # adapter "a" replaced in place, graphs kept
        after = engine.generate(_greedy(adapter=mix), timeout_s=300)
        assert engine.graph_error is None and keys and set(engine._graphs.graphs) == keys  # no new capture
    finally:
        engine.shutdown()
    eager = _run(_static(model, graphs=False, lora=lora), _greedy(adapter=mix))
    for x, y in zip(after, eager):
        assert x.output_ids == y.output_ids and x.logprobs == y.logprobs
    changed = [i for i in range(8) if mix(i) == "a" and before[i].output_ids != after[i].output_ids]
    assert changed  # the switch reached the captured graphs (the test can fail)
    assert all(before[i].output_ids == after[i].output_ids for i in range(8) if mix(i) != "a")


@needs_cuda
def test_graph_greedy_equals_the_merged_model_float32():
    dev, dt = torch.device("cuda"), torch.float32
    base = init_on_device(TINY_MOE, dev, dt, seed=0).eval()
    model = copy.deepcopy(base)
    lora = EngineLora(model, rank=8, targets=TARGETS)
    ad = _on(random_adapter(lora, 8, seed=4, alpha=4.0), dev, dt)
    lora.load(ad)
    engine = _static(model, lora=lora)
    outs = _run(engine, _greedy(12))
    assert engine._graphs.graphs and engine.graph_error is None
    ref = merged(base, ad)
    for i, out in enumerate(outs):
        ids = list(PROMPTS[i])
        for tok in out.output_ids:
            with torch.no_grad():
                want = int(ref(torch.tensor([ids], device=dev)).logits[0, -1].argmax())
            assert tok == want, (i, out.output_ids)
            ids.append(tok)
