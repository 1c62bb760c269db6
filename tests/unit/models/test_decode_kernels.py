"""The fused decode kernels (workers/models/blocks/decode_kernels.py) under Triton's CPU interpreter.

Each Triton kernel against its torch reference (the unfused path's ops): in float32 the residual
add, the rotary embedding and the KV-cache write bit for bit (slots that are not 0..B-1, the cache
rows outside the written positions untouched), the norms and SwiGLU's activation within float32
rounding (the norm's sum runs in another order); in bfloat16 within two units of the last place,
because the interpreter truncates float32 -> bfloat16 where a GPU rounds to nearest as torch does. Then a llama static engine decoding entirely
through the Triton kernels gives the dynamic engine's greedy tokens.
"""
from __future__ import annotations

from tests.helpers.triton_interpreter import assert_ok_under_interpreter

KERNELS = r"""
import torch
import workers.models.blocks.decode_kernels as dk

g = torch.Generator().manual_seed(0)
for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
    exact = dtype == torch.float32
    same = torch.equal if exact else lambda a, b: torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)
    x, d = (torch.randn(5, 1, 576, generator=g).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    torch.testing.assert_close(dk.rms_norm_triton(x, w, 1e-5), dk.rms_norm_reference(x, w, 1e-5), rtol=tol, atol=tol)
    s, n = dk.rms_norm_triton(x, w, 1e-5, d)
    assert same(s, x + d)
    torch.testing.assert_close(n, dk.rms_norm_reference(x + d, w, 1e-5), rtol=tol, atol=tol)
    gate, up = (torch.randn(5, 1, 1536, generator=g).to(dtype) for _ in range(2))
    torch.testing.assert_close(dk.silu_mul_triton(gate, up), torch.nn.functional.silu(gate) * up, rtol=tol, atol=tol)

    b, nh, nkv, hd, slots_n, max_len = 3, 9, 3, 64, 6, 16
    q = torch.randn(b, nh * hd, generator=g).to(dtype)
    k, v = (torch.randn(b, nkv * hd, generator=g).to(dtype) for _ in range(2))
    from workers.models.blocks.attention import rope_cos_sin, signed_sin
    pos = torch.tensor([0, 7, 15])
    cos, sin = rope_cos_sin(pos[:, None], hd, 100000.0, dtype)
    cos, ss = cos.reshape(b, hd).contiguous(), signed_sin(sin).reshape(b, hd).contiguous()
    slots = torch.tensor([4, 0, 2])
    caches = [[torch.randn(slots_n, max_len, nkv, hd, generator=g).to(dtype) for _ in range(2)]]
    caches.append([t.clone() for t in caches[0]])
    qa = dk.rope_write_kv_triton(q, k, v, cos, ss, *caches[0], slots, pos)
    qb = dk.rope_write_kv_reference(q, k, v, cos, ss, *caches[1], slots, pos)
    assert qa.shape == (b, nh, hd) and same(qa, qb), (qa - qb).abs().max()
    assert same(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert torch.equal(caches[0][1][slots, pos], v.view(b, nkv, hd))
    # row-strided q / k / v: column slices of one [b, (nh + 2 nkv) hd] output (fp8's fused q/k/v GEMM)
    qs, ks, vs = torch.cat([q, k, v], dim=1).split([nh * hd, nkv * hd, nkv * hd], dim=1)
    assert not vs.is_contiguous()
    caches = [[torch.zeros(slots_n, max_len, nkv, hd).to(dtype) for _ in range(2)] for _ in range(2)]
    qa = dk.rope_write_kv_triton(qs, ks, vs, cos, ss, *caches[0], slots, pos)
    qc = dk.rope_write_kv_reference(q, k, v, cos, ss, *caches[1], slots, pos)
    assert same(qa, qc) and same(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
print("ok")
"""

ENGINE = r"""
import dataclasses, torch
from benchmarks.gpu.bench_decode_step import smollm2_config
from tests.unit.inference.test_engine import PROMPTS, run
from workers.common.registry import MODELS
from workers.inference.embedded.engine import GenRequest, InferenceEngine
from workers.inference.embedded.static_engine import StaticEngine
import workers.models.blocks.decode_kernels as dk

calls = []
real = dk.rope_write_kv_triton
dk.rope_write_kv_triton = lambda *a: calls.append(1) or real(*a)
cfg = dataclasses.replace(smollm2_config(num_layers=2, vocab_size=256), hidden_size=128, dense_intermediate_size=256,
                          num_heads=4, num_kv_heads=2)
lm = MODELS.get("llama").build(cfg, dtype=torch.float32).init_weights(0)
reqs = [GenRequest(input_ids=p, temperature=0.0, max_new_tokens=5) for p in PROMPTS[:3]]
dyn = run(InferenceEngine(lm, max_batch_size=3, seed=0), [dataclasses.replace(r) for r in reqs])
sta = run(StaticEngine(lm, max_batch_size=3, seed=0, max_seq_len=64, sync_every=2, smallest_key_window=16), reqs)
assert calls, "the static decode step did not run the Triton kernels"
for a, b in zip(dyn, sta):
    assert a.output_ids == b.output_ids, (a.output_ids, b.output_ids)
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
print("ok")
"""


def test_decode_kernels_under_the_interpreter_equal_the_torch_references():
    assert_ok_under_interpreter(KERNELS)


def test_llama_static_decode_through_the_triton_kernels_equals_the_dynamic_engine():
    assert_ok_under_interpreter(ENGINE)


def test_off_cuda_the_self_check_refuses_and_cpu_tensors_keep_the_torch_ops(monkeypatch):
    """The kernels run on a CUDA device only after self_check passed there; a CPU device is refused by
    the check, and CPU tensors use the torch ops unless Triton's interpreter is on (these tests)."""
    import torch

    from workers.models.blocks import decode_kernels

    ok, why = decode_kernels.self_check(torch.device("cpu"))
    assert not ok and why
    from workers.models.blocks import decode_attention

    ok, why = decode_attention.self_check(torch.device("cpu"))
    assert not ok and why and not decode_attention.CHECKED
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not decode_kernels.usable(torch.zeros(2))


ATTENTION = r"""
import torch
from workers.models.blocks import decode_attention as da

g = torch.Generator().manual_seed(0)
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
    for hkv, grp, d, w in ((4, 8, 128, 80), (3, 3, 64, 130), (2, 1, 64, 17)):
        cache = torch.randn(5, 160, hkv, d, generator=g).to(dtype)
        vals = torch.randn(5, 160, hkv, d, generator=g).to(dtype)
        keys, values = cache[:3, :w], vals[:3, :w]  # slot views, strided like the engine's
        q = torch.randn(3, hkv, grp, d, generator=g).to(dtype)
        seen = torch.ones(3, w, dtype=torch.bool)
        seen[0, w // 2:] = False  # the causal end
        seen[1, : w - 5] = False  # a sliding window past the first blocks
        mask = torch.zeros(3, w, dtype=dtype).masked_fill_(~seen, float("-inf"))
        got = da.decode_attention_triton(q, keys, values, mask, d ** -0.5)
        want = da.decode_attention_reference(q, keys, values, mask, d ** -0.5)
        assert got.shape == want.shape == (3, hkv, grp, d)
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    none = torch.full((3, w), float("-inf"), dtype=dtype)  # an idle row that sees nothing: zeros, not NaN
    assert torch.equal(da.decode_attention_triton(q, keys, values, none, 0.1), torch.zeros_like(q))
print("ok")
"""


def test_decode_attention_under_the_interpreter_equals_sdpa():
    assert_ok_under_interpreter(ATTENTION)


SLOWER = r"""
import torch
from workers.models.blocks import decode_attention as da

calls = []
real = da.decode_attention_triton
da.decode_attention_triton = lambda *a: calls.append(1) or real(*a)
q = torch.randn(2, 3, 3, 64)
keys = values = torch.randn(2, 20, 3, 64)
mask = torch.zeros(2, 20)
da.decode_attention(q, keys, values, mask, 0.125)
assert calls == [1], "checked out (interpreter): the kernel runs"
da.SLOWER.add(("cpu", 3, 3, 64))  # a shape where start-up timing found the kernel slower
da.decode_attention(q, keys, values, mask, 0.125)
assert calls == [1], "a shape the kernel lost on keeps SDPA"
print("ok")
"""


def test_a_shape_where_the_kernel_lost_to_sdpa_keeps_sdpa():
    assert_ok_under_interpreter(SLOWER)
