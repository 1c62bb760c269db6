"""The fp8 engine's CUDA kernels (workers/inference/embedded/fp8_kernels.py) against the CPU reference math.

Skipped without CUDA (CI has none); needs a Hopper or Blackwell GPU for the fp8 GEMMs. The Triton
activation quantizer equals quantize_rows/quantize_groups (values and scales); the rowwise and block
``_scaled_mm`` and the grouped expert GEMM agree with the dequantized float32 reference; a static engine
over an fp8 qwen3_moe replays its CUDA graphs (grouped fp8 experts under capture) to the same greedy tokens
as its own eager steps, also after a weight update that re-quantizes in place.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from workers.inference.embedded import fp8_kernels
from workers.inference.embedded.engine import GenRequest
from workers.inference.embedded.fp8 import quantize_model
from workers.inference.embedded.fp8_quant import quantize_blocks, quantize_groups, quantize_rows, reference_linear
from workers.inference.embedded.static_engine import StaticEngine

needs_fp8 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                               reason="needs a Hopper or Blackwell GPU (CI has none)")
pytestmark = needs_fp8


def close(got, want, tol=0.02):
    return float((got.float() - want.float()).abs().max()) <= tol * float(want.float().abs().max())


@pytest.mark.parametrize("rows", [1, 7, 128, 300])
def test_triton_quantizer_equals_the_reference(rows):
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16) * 3
    q, s = fp8_kernels.quantize_activation(x)
    rq, rs = quantize_rows(x)
    assert torch.allclose(s, rs, rtol=1e-6)
    assert (q.float() == rq.float()).float().mean() > 0.999  # ties may round apart
    g, gs = fp8_kernels.quantize_activation(x, 128)
    rg, rgs = quantize_groups(x)
    assert gs.shape == (rows, 8) and gs.stride() == (1, rows) and torch.allclose(gs, rgs, rtol=1e-6)
    assert (g.float() == rg.float()).float().mean() > 0.999


@pytest.mark.parametrize("scheme", ["rowwise", "block"])
def test_scaled_linear_matches_the_reference(scheme):
    from workers.inference.embedded.fp8 import block_kernel_check

    if scheme == "block":
        ok, reason = block_kernel_check(torch.device("cuda"))
        if not ok:  # the engine then serves per-row scales (test below), never this kernel
            pytest.skip(f"no blockwise fp8 GEMM on this GPU stack: {reason}")
    w = torch.randn(512, 1024, device="cuda")  # K/128 = 8: the block layout fits_block admits
    q, s = quantize_blocks(w) if scheme == "block" else quantize_rows(w)
    for rows in (1, 16, 257):
        x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
        assert close(fp8_kernels.scaled_linear(x, q, s, scheme), reference_linear(x, q, s, scheme))


def test_the_start_up_check_picks_the_scheme_and_stacked_siblings_match():
    """The start-up check's verdict is what the swap uses (128x128 blocks where cuBLAS runs them, else
    per-row scales with the reason in the report: an H100 with torch 2.11 cu130 answers
    CUBLAS_STATUS_NOT_SUPPORTED), and q/k/v as one stacked GEMM give each projection's own fp8 output."""
    from workers.inference.embedded.fp8 import block_kernel_check, fp8_matmul

    ok, reason = block_kernel_check(torch.device("cuda"))
    scheme = "block" if ok else "rowwise"
    from benchmarks.gpu.bench_fp8_decode import random_model
    from workers.models.qwen3_moe.config import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=384, hidden_size=512, num_layers=1, num_heads=8, num_kv_heads=2, head_dim=64,
                         num_experts=4, top_k=2, expert_intermediate_size=128, max_position_embeddings=128)
    lm = random_model("qwen3_moe", cfg, torch.device("cuda"))
    report = quantize_model(lm)
    assert report[scheme] == 4 and report["fused_groups"] == 1 and report["block_reason"], (report, reason)
    attn = lm.model.layers[0].self_attn
    x = torch.randn(3, 7, 512, device="cuda", dtype=torch.bfloat16)
    got = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    for m, y in zip((attn.q_proj, attn.k_proj, attn.v_proj), got):
        assert close(y.reshape(21, -1), fp8_matmul(x.reshape(21, 512), m.qweight, m.qscale, scheme))


def test_grouped_expert_gemm_matches_per_expert_reference():
    assert fp8_kernels.grouped_available()
    stack = torch.randn(4, 256, 128, device="cuda")
    q, s = quantize_rows(stack)
    counts = torch.tensor([5, 0, 17, 3], device="cuda")
    offs = counts.cumsum(0).to(torch.int32)
    x = torch.randn(int(counts.sum()), 128, device="cuda", dtype=torch.bfloat16)
    got = fp8_kernels.scaled_grouped(x, q, s, offs)
    starts = [0] + offs.tolist()[:-1]
    for e, (a, b) in enumerate(zip(starts, offs.tolist())):
        if b > a:
            assert close(got[a:b], reference_linear(x[a:b], q[e], s[e], "rowwise"))


def test_fp8_engine_graphs_equal_eager_and_follow_weight_updates():
    from benchmarks.gpu.bench_fp8_decode import moe_config, random_model

    cfg, cuda = moe_config(0, toy=True), torch.device("cuda")
    base, update = random_model("qwen3_moe", cfg, cuda, seed=0), random_model("qwen3_moe", cfg, cuda, seed=1).state_dict()
    reqs = [GenRequest(input_ids=[3 + i, 9, 27 + i], temperature=0.0, max_new_tokens=12) for i in range(5)]

    def run(graphs):
        lm = copy.deepcopy(base)
        report = quantize_model(lm)
        assert report["experts"] == 2 and report["block"] + report["rowwise"] == 8
        e = StaticEngine(lm, max_batch_size=8, seed=0, max_seq_len=128, sync_every=4, cuda_graphs=graphs).start()
        try:
            first = [o.output_ids for o in e.generate([dataclasses.replace(r) for r in reqs], timeout_s=300)]
            e.apply_weights(update, 1, source="new")  # re-quantized in place: the captured graphs read it
            second = [o.output_ids for o in e.generate([dataclasses.replace(r) for r in reqs], timeout_s=300)]
            return first, second, e.graph_error
        finally:
            e.shutdown()

    eager, graphed = run(False), run(True)
    assert graphed[2] is None and graphed[:2] == eager[:2] and eager[0] != eager[1]
