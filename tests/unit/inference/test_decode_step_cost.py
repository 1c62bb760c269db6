"""What the static engine's decode step launches (benchmarks/gpu/bench_decode_step.py counts it).

A small model's decode step is a few hundred tiny kernels in one CUDA-graph replay, so their count
is its cost (issue 45). Checked on CPU: the per-layer kernel count at SmolLM2-135M's layer shapes
stays at what the fused decode kernels gave (44 -> 38 with the fused rotary and the once-per-forward
mask; 38 -> 14 with workers/models/blocks/decode_fused.py: one op each for a norm, the residual add
+ norm, rotary + KV write and SwiGLU's activation), and that path decodes exactly as the dynamic
engine does (CPU: the ops' torch references are the unfused code); the sampling graph skips the top-p sort when no request asks for top_p < 1; and every shortcut is
bit-exact (rotary of q and k together; SAMPLE equals NUCLEUS at top_p = 1).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks.gpu.bench_decode_step import build_engine, kernel_counts, kernels_per_step, smollm2_config
from tests.unit.inference.test_engine import PROMPTS, run
from workers.inference.embedded.engine import GenRequest
from workers.inference.embedded.slot_state import GREEDY, NUCLEUS, SAMPLE, decode_mode
from workers.models.blocks.attention import apply_rope, apply_rope_qk, rope_cos_sin, signed_sin


@pytest.fixture(scope="module")
def cfg():
    return smollm2_config(num_layers=2, vocab_size=512)


def test_kernels_per_layer_at_smollm2_shapes(cfg):
    counts = kernel_counts(cfg, rows=8, device=torch.device("cpu"), dtype=torch.bfloat16)
    assert counts["kernels_per_layer"] <= 14, counts  # 38 before decode_fused.py (44 before the fused rotary)
    assert counts["kernels_outside_layers"] <= 79, counts  # 84 before: the final norm one op


def test_fused_llama_decode_equals_the_dynamic_engine(cfg):
    """Greedy tokens and logprobs of the fused decode path (SmolLM2's layer, GQA 3:1) equal the
    dynamic engine's (the general path, no static cache) over prompts of different lengths."""
    from workers.inference.embedded.engine import InferenceEngine

    engine = build_engine(cfg, rows=4, device=torch.device("cpu"), dtype=torch.float32, max_seq_len=64, start=False)
    reqs = [GenRequest(input_ids=p, temperature=0.0, max_new_tokens=6) for p in PROMPTS[:4]]
    dyn = run(InferenceEngine(engine.model, max_batch_size=4, seed=0), [dataclasses.replace(r) for r in reqs])
    sta = run(engine, reqs)
    for a, b in zip(dyn, sta):
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


def test_nucleus_only_when_asked(cfg):
    reqs = [GenRequest(input_ids=[1, 2], temperature=t, top_p=p, max_new_tokens=1)
            for t, p in ((0.0, 0.5), (1.0, 1.0))]
    assert decode_mode(reqs[:1]) == GREEDY  # a greedy request's top_p does not matter
    assert decode_mode(reqs) == SAMPLE
    assert decode_mode([*reqs, dataclasses.replace(reqs[1], top_p=0.9)]) == NUCLEUS
    engine = build_engine(cfg, rows=4, device=torch.device("cpu"), dtype=torch.float32, max_seq_len=64)
    try:  # the sort of every row's vocabulary and its cumsum/scatter are gone from SAMPLE
        assert kernels_per_step(engine, 4, NUCLEUS) - kernels_per_step(engine, 4, SAMPLE) >= 6
    finally:
        engine.shutdown()


def test_sample_equals_nucleus_at_top_p_one(cfg, monkeypatch):
    """Same seed, same requests at top_p 1: forcing the nucleus path changes no token and no logprob."""
    import workers.inference.embedded.static_engine as se

    reqs = [GenRequest(input_ids=p, temperature=1.0, max_new_tokens=7) for p in PROMPTS[:4]]

    def outs():
        engine = build_engine(cfg, rows=4, device=torch.device("cpu"), dtype=torch.float32, max_seq_len=64, start=False)
        return [(o.output_ids, o.logprobs) for o in run(engine, [dataclasses.replace(r) for r in reqs])]

    plain = outs()
    monkeypatch.setattr(se, "decode_mode", lambda rs: NUCLEUS)
    assert outs() == plain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_of_q_and_k_together_is_bit_exact(dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 9, 5, 64, generator=g).to(dtype)
    k = torch.randn(3, 3, 5, 64, generator=g).to(dtype)
    cos, sin = rope_cos_sin(torch.randint(0, 4000, (3, 5), generator=g), 64, 100000.0, dtype)
    q2, k2 = apply_rope_qk(q, k, cos, signed_sin(sin))
    assert torch.equal(q2, apply_rope(q, cos, sin)) and torch.equal(k2, apply_rope(k, cos, sin))


def _qwen3_moe_engine(rows: int, dtype: torch.dtype):
    from benchmarks.gpu.bench_fp8_decode import moe_config, random_model
    from workers.inference.embedded.static_engine import StaticEngine

    model = random_model("qwen3_moe", moe_config(2, toy=True), torch.device("cpu")).to(dtype)
    return StaticEngine(model, max_batch_size=rows, seed=0, max_seq_len=64, cuda_graphs=False)


def test_kernels_per_layer_of_a_qwen3_moe_decode_layer():
    """Qwen3's q/k norms and a routed MLP take the fused path too: 99 ops per layer before (norms as
    five ops each, the balance loss computed every step), 48 with it (one is the int16 cast of the sort keys)."""
    from workers.inference.embedded.slot_state import SAMPLE

    counts = {}
    for depth in (1, 2):
        engine = _qwen3_moe_engine(8, torch.bfloat16)
        engine.model.model.layers = engine.model.model.layers[:depth]
        engine.start()
        try:
            counts[depth] = kernels_per_step(engine, 8, SAMPLE)
        finally:
            engine.shutdown()
    assert counts[2] - counts[1] <= 48, counts


def test_fused_qwen3_moe_decode_equals_the_dynamic_engine():
    """Greedy tokens, logprobs and every position's routed experts (what Router Replay sends the
    trainer) of the fused decode path equal the dynamic engine's general path."""
    from workers.inference.embedded.engine import InferenceEngine

    engine = _qwen3_moe_engine(4, torch.float32)
    reqs = [GenRequest(input_ids=p, temperature=0.0, max_new_tokens=6, return_routed_experts=True) for p in PROMPTS[:4]]
    dyn = run(InferenceEngine(engine.model, max_batch_size=4, seed=0), [dataclasses.replace(r) for r in reqs])
    sta = run(engine, reqs)
    for a, b in zip(dyn, sta):
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
        assert a.routed_experts is not None and torch.equal(torch.as_tensor(a.routed_experts),
                                                             torch.as_tensor(b.routed_experts))


def test_the_engine_times_the_decode_attention_at_its_own_shapes(cfg, monkeypatch):
    """At start-up on a GPU the static engine times the decode-attention kernel against SDPA at its
    model's heads (SmolLM2: 9 over 3 of 64) and slots; a failing timing turns the kernel off."""
    from workers.inference.embedded.static_engine import choose_decode_attention
    from workers.models.blocks import decode_attention

    seen = []
    monkeypatch.setattr(decode_attention, "CHECKED", {"cuda:0": True})
    monkeypatch.setattr(decode_attention, "time_against_sdpa", lambda *a, **k: seen.append(k) or (5.0, 3.0))
    choose_decode_attention(cfg, torch.device("cuda:0"), torch.bfloat16, 128, [256, 512, 4096])
    assert seen == [dict(rows=64, kv_heads=3, group=3, head_dim=64, windows=[256, 2048])]

    def broken(*a, **k):
        raise RuntimeError("no kernel image")

    monkeypatch.setattr(decode_attention, "time_against_sdpa", broken)
    choose_decode_attention(cfg, torch.device("cuda:0"), torch.bfloat16, 128, [256])
    assert decode_attention.CHECKED["cuda:0"] is False
