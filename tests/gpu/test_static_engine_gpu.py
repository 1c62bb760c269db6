"""The static engine's CUDA-graph decode path (issue 24) against the dynamic engine on a GPU.

Skipped without CUDA (CI has none; results of the last run are in benchmarks/results/gpu/).
float32: greedy tokens and routed experts of the graph path equal the dynamic engine's exactly
(the MoE experts run dense under capture, the reference loop in the dynamic engine: the same
function up to rounding). bfloat16 (grouped-GEMM experts): replaying the graphs gives bit for bit
what the same static engine computes eagerly, also after a weight update of a running engine (the
graphs read the MoE expert stacks in place), and seeded sampling is reproducible.
"""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from benchmarks.gpu.common import TINY_MOE, init_on_device
from workers.inference.embedded.decode_loop import StaticEngine
from workers.inference.embedded.engine import GenRequest, InferenceEngine

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none; see benchmarks/results/gpu)")
PROMPTS = [[(7 * i + j) % 500 + 3 for j in range(5 + 9 * i)] for i in range(11)]


def _run(engine, reqs):
    engine.start()
    try:
        return engine.generate([dataclasses.replace(r) for r in reqs], timeout_s=300)
    finally:
        engine.shutdown()


def _static(model, graphs=True, **kw):
    return StaticEngine(model, max_batch_size=8, seed=3, max_seq_len=256, prefill_chunk=16, sync_every=4,
                        cuda_graphs=graphs, **kw)


def _greedy(n=24, routed=True):
    return [GenRequest(rid=str(i), input_ids=p, temperature=0.0, max_new_tokens=n - i, return_routed_experts=routed)
            for i, p in enumerate(PROMPTS)]


@needs_cuda
def test_graph_path_greedy_equals_the_dynamic_engine_float32():
    model = init_on_device(TINY_MOE, torch.device("cuda"), torch.float32, seed=0).eval()
    engine = _static(model)
    dyn = _run(InferenceEngine(model, max_batch_size=8, seed=0), _greedy())
    sta = _run(engine, _greedy())
    assert engine._graphs.graphs and engine.graph_error is None and engine.num_steps > 0
    for a, b in zip(dyn, sta):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
        assert torch.equal(a.routed_experts, b.routed_experts)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3


@needs_cuda
def test_graph_replay_equals_eager_bfloat16():
    model = init_on_device(TINY_MOE, torch.device("cuda"), torch.bfloat16, seed=0).eval()
    graphs, eager = _run(_static(model), _greedy()), _run(_static(model, graphs=False), _greedy())
    for x, y in zip(graphs, eager):
        assert x.output_ids == y.output_ids and x.logprobs == y.logprobs
        assert torch.equal(x.routed_experts, y.routed_experts)


@needs_cuda
def test_weight_update_reaches_running_graphs_bfloat16():
    """Same engine, update between two batches: its graphs (captured once) must see new experts."""
    model = init_on_device(TINY_MOE, torch.device("cuda"), torch.bfloat16, seed=0).eval()
    scaled = {k: v * 1.5 for k, v in model.state_dict().items() if ".experts." in k}
    graph_engine = _static(model).start()
    try:
        graph_engine.generate(_greedy(8), timeout_s=300)
        graph_engine.apply_weights(scaled, 2, source="test")
        graph_engine.pause()  # queue the whole batch first: the admission order of a fresh engine
        done = []
        for r in _greedy(16):
            graph_engine.submit(r, done.append)
        graph_engine.resume()
        deadline = time.monotonic() + 300
        while len(done) < len(PROMPTS):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        after = sorted(done, key=lambda o: int(o.rid))
    finally:
        graph_engine.shutdown()
    eager = _run(_static(model, graphs=False), _greedy(16))
    assert [o.output_ids for o in after] == [o.output_ids for o in eager]
    assert all(set(o.token_versions) == {2} for o in after)


@needs_cuda
def test_seeded_sampling_in_graphs_is_reproducible():
    model = init_on_device(TINY_MOE, torch.device("cuda"), torch.bfloat16, seed=0).eval()
    reqs = [GenRequest(input_ids=p, temperature=0.8, top_p=0.9, max_new_tokens=20) for p in PROMPTS]
    a, b = _run(_static(model), reqs), _run(_static(model), reqs)
    c = _run(StaticEngine(model, max_batch_size=8, seed=4, max_seq_len=256, prefill_chunk=16, sync_every=4), reqs)
    assert [o.output_ids for o in a] == [o.output_ids for o in b] != [o.output_ids for o in c]
    assert all(all(lp <= 0 for lp in o.logprobs) and len(o.output_ids) == 20 for o in a)
