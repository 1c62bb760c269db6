"""FP8 rollouts (workers/inference/embedded/fp8.py) on CPU: the reference math the CUDA kernels compute.

Quantize/dequantize round trips (row and 128x128 block scales), the module swap (parameters, names and
state_dict unchanged; embeddings, norms, router and LM head stay bf16), re-quantization after a weight
update (a full step through apply_weights and an in-place sparse patch) equal to quantizing the new
bf16 weights directly and touching only what changed, the grouped expert path against the per-expert
loop, and an fp8 engine's logits and sampled-token logprobs against the bf16 model's (errors and KL
printed: ``pytest -s``).
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import workers.models.blocks.kernels as kernels
from workers.common.registry import MODELS
from workers.inference.embedded.engine import GenRequest
from workers.inference.embedded.fp8 import Fp8Linear, quantize_model, refresh
from workers.inference.embedded.fp8_quant import FP8, dequantize_blocks, dequantize_rows, quantize_blocks, quantize_rows
from workers.inference.embedded.fp8_experts import Fp8Experts
from workers.inference.embedded.static_engine import StaticEngine
from workers.models.qwen3_moe.config import Qwen3MoeConfig

E4M3_REL = 2.0 ** -4  # e4m3: 3 mantissa bits, so rounding moves a normal value by at most 1/16 of it


def tiny_moe(hidden: int = 512, seed: int = 0):
    """A 2-layer qwen3_moe: output widths multiples of 128, input widths of 512 (block scales) and 4
    routed experts per layer."""
    cfg = Qwen3MoeConfig(vocab_size=384, hidden_size=hidden, num_layers=2, num_heads=hidden // 64, num_kv_heads=2, head_dim=64,
                         num_experts=4, top_k=2, expert_intermediate_size=128, max_position_embeddings=128)
    return MODELS.get("qwen3_moe").build(cfg, dtype=torch.float32).init_weights(seed).to(torch.bfloat16)


def kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    p, q = ref_logits.float().log_softmax(-1), logits.float().log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


@pytest.mark.parametrize("shape", [(48, 80), (3, 5, 32)])
def test_row_scales_round_trip_within_e4m3_precision(shape):
    w = torch.randn(shape) * torch.logspace(-3, 2, shape[-2])[:, None]  # rows of very different magnitudes
    q, s = quantize_rows(w)
    assert q.dtype == FP8 and s.shape == shape[:-1]
    back = dequantize_rows(q, s)
    amax = w.abs().amax(-1, keepdim=True)
    assert torch.allclose(back.abs().amax(-1, keepdim=True), amax, rtol=1e-6)  # each row's amax is exact (448)
    err = (back - w).abs()
    # relative within 1/16 for normal values, absolute within the subnormal step (2^-9 of the scale) below them
    assert bool((err <= E4M3_REL * w.abs() + 2.0 ** -9 * s[..., None] + 1e-12).all())


def test_block_scales_round_trip_and_isolate_outliers():
    w = torch.randn(256, 384)
    w[0, 0] = 1000.0  # an outlier only coarsens its own 128x128 block
    q, s = quantize_blocks(w)
    assert s.shape == (2, 3)
    back = dequantize_blocks(q, s)
    assert (back - w)[128:, :].abs().max() <= E4M3_REL * w[128:, :].abs().max()
    assert (back - w)[:128, 128:].abs().max() <= E4M3_REL * w[:128, 128:].abs().max()
    assert float(back[0, 0]) == 1000.0


def test_swap_keeps_parameters_and_quantizes_only_projections_and_experts():
    lm = tiny_moe()
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    report = quantize_model(lm)
    assert report == {"block": 8, "rowwise": 0, "experts": 2, "fused_groups": 2, "kept_bf16": [],  # q/k/v/o x 2 layers
                      "block_reason": "cpu: the float32 reference"}
    after = lm.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    swapped = {n for n, m in lm.named_modules() if isinstance(m, (Fp8Linear, Fp8Experts))}
    assert swapped == {f"model.layers.{i}.{p}" for i in range(2) for p in
                       ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.experts")}
    assert type(lm.model.layers[0].mlp.gate) is nn.Linear  # the router stays bf16
    q = lm.model.layers[0].self_attn.q_proj
    assert q.qweight.dtype == FP8 and q.weight.dtype == torch.bfloat16 and q.scheme == "block"
    rel = (q.dequantized() - q.weight.float()).abs().max() / q.weight.float().abs().max()
    assert 0 < rel <= E4M3_REL


def test_rowwise_when_widths_are_not_multiples_of_128():
    from benchmarks.gpu.bench_decode_step import smollm2_config

    lm = MODELS.get("llama").build(smollm2_config(num_layers=1, vocab_size=256), dtype=torch.bfloat16).init_weights(0)
    report = quantize_model(lm)
    assert report["rowwise"] == 7 and report["block"] == 0  # hidden 576: row scales for every projection
    assert quantize_model(tiny_moe(), blocks=False)["rowwise"] == 8  # a GPU without blockwise kernels


def test_requantized_after_full_update_and_sparse_patch_equals_direct_quantization():
    lm = tiny_moe()
    quantize_model(lm)
    engine = StaticEngine(lm, max_batch_size=2, seed=0, max_seq_len=64, sync_every=2)
    new = tiny_moe(seed=7).state_dict()
    engine.apply_weights(new, 1, source="step_1")
    q = lm.model.layers[1].self_attn.o_proj
    direct_q, direct_s = quantize_blocks(new["model.layers.1.self_attn.o_proj.weight"])
    assert torch.equal(q.qweight.view(torch.uint8), direct_q.view(torch.uint8))
    assert torch.equal(q.qscale, direct_s)
    experts = lm.model.layers[0].mlp.experts
    gate3 = new["model.layers.0.mlp.experts.3.gate_proj.weight"]
    assert torch.equal(experts.gate_up_proj_q[3, :128].view(torch.uint8), quantize_rows(gate3)[0].view(torch.uint8))

    def patch(params):  # a sparse in-place patch of two tensors (workers/weights/broadcast/delta_wire.py's way)
        params["model.layers.0.self_attn.k_proj.weight"][5, :7] += 0.5
        params["model.layers.1.mlp.experts.2.down_proj.weight"][0, 3] = 2.0

    engine.patch_weights(patch, 2, source="patch_2")
    k = lm.model.layers[0].self_attn.k_proj
    assert torch.equal(k.qweight.view(torch.uint8), quantize_blocks(k.weight.detach())[0].view(torch.uint8))
    down = lm.model.layers[1].mlp.experts
    assert torch.equal(down.down_proj_q.view(torch.uint8), quantize_rows(down.down_proj.detach())[0].view(torch.uint8))
    assert refresh(lm) == 0  # nothing changed since: nothing re-quantized
    engine.patch_weights(patch, 3, source="patch_3")
    assert refresh(lm) == 0  # the engine re-quantized the two patched modules itself
    engine.shutdown()


def test_grouped_expert_path_equals_the_loop():
    """Fp8Experts' grouped path (one fp8 grouped GEMM per projection on a GPU; its math group by group here)
    against its per-expert loop, on the same rows sorted by expert, gate weights applied."""
    lm = tiny_moe()
    quantize_model(lm)
    experts = lm.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(23, 512, generator=g).to(torch.bfloat16)
    counts, gates = torch.tensor([5, 0, 11, 7]), torch.rand(23, generator=g)
    out = {}
    with torch.no_grad():
        for fast in (False, True):
            kernels.FAST_PATH_ON_CPU = fast
            try:
                assert experts.grouped_ok(rows)
                out[fast] = [experts(rows, counts, row_scale=scale).float() for scale in (None, gates)]
            finally:
                kernels.FAST_PATH_ON_CPU = False
    (loop, loop_gated), (grouped, grouped_gated) = out[False], out[True]
    assert (grouped - loop).abs().max() <= 1e-2 * loop.abs().max()  # the same math: bf16 rounding apart
    # the grouped path scales the activation before the down projection's fp8 quantization, the loop the
    # output after it: the two differ by fp8 rounding (at most 1/16 of a value), not more
    assert (grouped_gated - loop_gated).abs().max() <= E4M3_REL * loop_gated.abs().max()


def test_fp8_logits_and_engine_logprobs_close_to_bf16():
    ref = tiny_moe()
    lm = copy.deepcopy(ref)
    quantize_model(lm)
    ids = torch.randint(0, 384, (4, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ref(ids).logits.float(), lm(ids).logits.float()
    err, scale, div = (a - b).abs(), a.abs().mean(), kl(a, b)
    print(f"\nfp8 vs bf16 logits: max error {err.max():.4f}, mean {err.mean():.4f} (mean |logit| {scale:.4f}), "
          f"KL {div:.2e}")
    assert err.mean() < 0.15 * scale and div < 5e-3
    prompts = [[int(t) for t in row[:8]] for row in ids]
    outs = {}
    for name, model in (("bf16", ref), ("fp8", lm)):
        eng = StaticEngine(model, max_batch_size=4, seed=0, max_seq_len=64, sync_every=4).start()
        eng.apply_weights(ref.state_dict(), 1, source="same")  # the published bf16 step, re-quantized by fp8
        try:
            outs[name] = eng.generate([GenRequest(input_ids=p, temperature=0.0, max_new_tokens=6) for p in prompts])
        finally:
            eng.shutdown()
    agree = sum(x.output_ids == y.output_ids for x, y in zip(outs["bf16"], outs["fp8"]))
    assert agree >= 2 and all(o.weight_version == 1 and len(o.logprobs) == 6 for o in outs["fp8"])
