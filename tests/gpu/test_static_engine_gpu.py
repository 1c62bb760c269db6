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
from workers.inference.embedded.static_engine import StaticEngine
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


def _hybrid_and_dsa_models(device, dtype):
    """nemotron_h (Mamba-2 state, NoPE attention, LatentMoE) and glm_moe_dsa (MLA latent + DSA index
    keys) at the sizes of hydra_conf/model/*_tiny.yaml, with room for PROMPTS (no transformers needed)."""
    from workers.common.registry import MODELS

    room = dict(vocab_size=512, max_position_embeddings=256, init_seed=1234)
    cfgs = {
        "nemotron_h": dict(hidden_size=64, num_layers=4, hybrid_override_pattern="ME*-", num_heads=4, num_kv_heads=2,
                           head_dim=16, intermediate_size=128, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16,
                           mamba_n_groups=2, num_experts=8, top_k=2, expert_intermediate_size=32,
                           shared_expert_intermediate_size=64, num_shared_experts=1, moe_latent_size=32, n_group=2,
                           topk_group=1, routed_scaling_factor=2.5),
        "glm_moe_dsa": dict(hidden_size=64, num_layers=3, num_heads=4, num_experts=8, top_k=2,
                            expert_intermediate_size=32, num_shared_experts=1, num_dense_layers=1,
                            dense_intermediate_size=128, num_expert_groups=4, topk_groups=2, routed_scaling_factor=2.5,
                            q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                            num_indexer_heads=4, indexer_head_dim=16, index_topk=8, rope_theta=10000.0),
    }
    for family, kw in cfgs.items():
        spec = MODELS.get(family)
        cfg = spec.config(name=f"{family}_gpu_test", family=family, **room, **kw)
        yield family, spec.init(cfg, dtype).to(device).eval()


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba2_state_and_dsa_keys_in_graphs(dtype):
    """Greedy tokens and routing of the graph path equal the same static engine's eager steps: per-slot
    Mamba-2 state (frozen in the warm-up runs of every capture) and DSA index keys under CUDA graphs.
    Not the dynamic engine: at random init many DSA index scores are exactly 0 (a ReLU of q.k), and
    which of those tied keys top-k keeps depends on the cache layout (left-padded vs slots); the CPU
    parity tests compare both engines with transformers on weights without such ties."""
    for family, model in _hybrid_and_dsa_models(torch.device("cuda"), dtype):
        engine = _static(model)
        sta = _run(engine, _greedy())
        assert engine._graphs is not None and engine._graphs.graphs and engine.graph_error is None, (family,
                                                                                                    engine.graph_error)
        ref = _run(_static(model, graphs=False), _greedy())
        for a, b in zip(ref, sta):
            assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason, family
            assert torch.equal(a.routed_experts, b.routed_experts), family


@needs_cuda
def test_the_fused_decode_kernels_check_out_on_this_gpu():
    """The static engine runs its Triton decode kernels only where this start-up check passes
    (workers/models/blocks/decode_kernels.py ``self_check``); on a GPU it must pass, or the decode step
    silently keeps its 38 ops a layer."""
    from workers.models.blocks import decode_kernels

    ok, why = decode_kernels.self_check(torch.device("cuda"))
    assert ok, why
    assert decode_kernels.usable(torch.zeros(1, device="cuda"))
