"""Sibling fp8 projections as one GEMM (workers/inference/embedded/fp8_fused.py), the block-scale layout
torch's blockwise ``_scaled_mm`` reads, and the bf16 view of an fp8 model, on CPU (the reference math).

The stacked GEMM gives every sibling the output its own fp8 GEMM gives (any call order; another input
recomputes), a whole model's logits equal the unstacked fp8 model's, a weight update re-quantizes into
the stacked buffer, and ``bf16_forward`` turns the same resident model back into the bf16 one.
"""
from __future__ import annotations

import copy

import pytest
import torch

from workers.common.registry import MODELS
from workers.inference.embedded.fp8 import bf16_forward, block_kernel_check, fp8_matmul, quantize_model
from workers.inference.embedded.fp8_quant import fits_block, quantize_blocks, quantize_rows
from workers.models.qwen3_moe.config import Qwen3MoeConfig


def tiny_moe(seed: int = 0):
    cfg = Qwen3MoeConfig(vocab_size=384, hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64,
                         num_experts=4, top_k=2, expert_intermediate_size=128, max_position_embeddings=128)
    return MODELS.get("qwen3_moe").build(cfg, dtype=torch.float32).init_weights(seed).to(torch.bfloat16)


def smollm(layers: int = 1):
    from benchmarks.gpu.bench_decode_step import smollm2_config

    cfg = smollm2_config(num_layers=layers, vocab_size=256)
    return MODELS.get("llama").build(cfg, dtype=torch.bfloat16).init_weights(0)


@pytest.mark.parametrize("make,scheme", [(tiny_moe, "block"), (smollm, "rowwise")])
def test_siblings_share_one_gemm_with_each_ones_own_output(make, scheme):
    lm = make()
    report = quantize_model(lm)
    attn = lm.model.layers[0].self_attn
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    assert q.fused is k.fused is v.fused is not None and q.scheme == scheme
    group = q.fused
    assert q.qweight.data_ptr() == group.qweight.data_ptr()  # a view of the stacked buffer, not a copy
    assert k.qweight.data_ptr() == group.qweight[q.out_features:].data_ptr()
    x = torch.randn(2, 5, lm.config.hidden_size).to(torch.bfloat16)
    own = {m: fp8_matmul(x.reshape(-1, x.shape[-1]), m.qweight, m.qscale, m.scheme).view(2, 5, -1) for m in (q, k, v)}
    for order in ((q, k, v), (v, q, k)):
        got = {m: m(x) for m in order}
        for m in (q, k, v):
            assert got[m].shape == (2, 5, m.out_features)
            assert torch.allclose(got[m].float(), own[m].float(), rtol=1e-2, atol=1e-3)
        assert group._input is None and not group._pending  # nothing held between steps
    other = torch.randn(2, 5, lm.config.hidden_size).to(torch.bfloat16)
    q(x)
    assert not torch.equal(k(other), k(x))  # another input is computed, never a stale slice
    if make is smollm:
        mlp = lm.model.layers[0].mlp
        assert mlp.gate_proj.fused is mlp.up_proj.fused is not None and report["fused_groups"] == 2


def test_stacked_model_logits_equal_the_unstacked_fp8_model():
    ref = tiny_moe()
    fused, plain = copy.deepcopy(ref), copy.deepcopy(ref)
    assert quantize_model(fused)["fused_groups"] == 2
    assert quantize_model(plain, fuse=False)["fused_groups"] == 0
    ids = torch.randint(0, 384, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = fused(ids).logits.float(), plain(ids).logits.float()
    assert (a - b).abs().max() <= 2e-2 * b.abs().max()  # float32 summation order apart, then bf16


def test_weight_update_requantizes_into_the_stacked_buffer():
    lm = tiny_moe()
    quantize_model(lm)
    k = lm.model.layers[1].self_attn.k_proj
    with torch.no_grad():
        k.weight.mul_(3.0)  # an in-place update, as the engine's loaders write
    from workers.inference.embedded.fp8 import refresh

    assert refresh(lm) == 1
    want_q, want_s = quantize_blocks(k.weight.detach())
    group = k.fused
    a, b = group.columns[1]
    assert torch.equal(group.qweight[a:b].view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(group.qscale[a // 128:b // 128], want_s)


def test_bf16_forward_is_the_unquantized_model_and_restores_fp8():
    ref = tiny_moe()
    lm = copy.deepcopy(ref)
    quantize_model(lm)
    ids = torch.randint(0, 384, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, fp8 = ref(ids).logits, lm(ids).logits
        with bf16_forward(lm):
            same = lm(ids).logits
        again = lm(ids).logits
    assert torch.equal(same, want) and torch.equal(again, fp8) and not torch.equal(fp8, want)


def test_block_scales_have_the_layout_blockwise_scaled_mm_reads():
    """Weight scales [N/128, K/128] row-major with K/128 a multiple of 4 (16-byte rows; torch checks the
    row stride against K/128 in some versions and against K/128 rounded up to 4 in others), and torch's
    own shape check (the meta kernel) accepts the (1x128, 128x128) call fp8_kernels.scaled_linear makes."""
    assert fits_block(384, 1024) and not fits_block(384, 384) and not fits_block(200, 1024)
    q, s = quantize_blocks(torch.randn(384, 1024))
    assert s.shape == (3, 8) and s.is_contiguous() and s.stride(0) % 4 == 0
    m = 5
    xq = torch.empty(m, 1024, dtype=torch.float8_e4m3fn, device="meta")
    xs = torch.empty(8, m, device="meta").t()  # outer-dim-major, as quantize_activation writes it
    out = torch._scaled_mm(xq, q.to("meta").t(), scale_a=xs, scale_b=s.to("meta").t(), out_dtype=torch.bfloat16)
    assert out.shape == (m, 384)
    assert block_kernel_check(torch.device("cpu"))[0]
    assert quantize_rows(torch.randn(4, 16))[1].shape == (4,)


def test_bench_per_layer_slope_and_projection():
    """benchmarks/gpu/bench_fp8_decode.py's depth model: step = fixed + layers x slope for each engine."""
    from benchmarks.gpu.bench_fp8_decode import per_layer

    row = lambda n, b, f: {"layers": n, "bf16": {"decode_step_ms": b}, "fp8": {"decode_step_ms": f}}  # noqa: E731
    out = per_layer(row(4, 1.0 + 4 * 0.5, 1.2 + 4 * 0.25), row(16, 1.0 + 16 * 0.5, 1.2 + 16 * 0.25))
    assert out["bf16"]["ms_per_layer"] == pytest.approx(0.5) and out["fp8"]["fixed_ms"] == pytest.approx(1.2)
    assert out["per_layer_fp8_over_bf16"] == pytest.approx(2.0)
    assert out["projected_fp8_over_bf16"] == pytest.approx((1.0 + 48 * 0.5) / (1.2 + 48 * 0.25))
