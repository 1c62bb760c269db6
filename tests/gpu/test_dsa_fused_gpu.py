"""DSA's fused sparse-latent attention kernel compiled for the GPU (workers/models/blocks/dsa_fused.py),
against the torch reference at GLM-5's widths (latent 512 + rope 64, 64 heads, top-2048 keys): the CPU
tests run the same kernel under Triton's interpreter only at tiny widths, so the autotuned block sizes,
the atomics of the backward and bf16 inputs (float32 ones take the torch reference on CUDA) are
checked here; and the index-score kernel's bf16 tensor-core dots (the CPU interpreter's bf16 dot is
broken, so the CPU tests run them upcast). Each kernel is autotuned once (one head count, one width):
well under a minute on an H100 with compilation."""
from __future__ import annotations

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none; see benchmarks/results/gpu)")


def _case(dtype: torch.dtype, t: int, s: int, k: int, heads: int = 64, r: int = 512, dr: int = 64):
    from workers.models.blocks.dsa_fused import fused_applies, latent_reference, sparse_latent_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, heads, t, r + dr, device="cuda", generator=g).to(dtype)
    entry = torch.randn(1, s, r + dr, device="cuda", generator=g).to(dtype)
    first = s - t  # the queries are the last t positions: query i sees keys <= first + i
    score = torch.randn(1, t, s, device="cuda", generator=g)
    future = torch.arange(s, device="cuda")[None, :] > (first + torch.arange(t, device="cuda"))[:, None]
    vals, idx = score.masked_fill(future, float("-inf")).topk(min(k, s), -1)
    chosen = torch.where(vals > float("-inf"), idx, -1).to(torch.int32)
    w = torch.randn(1, heads, t, r, device="cuda", generator=g).to(dtype)
    assert fused_applies(q)
    got = []
    for fn, cast in ((latent_reference, torch.float32), (sparse_latent_attention, dtype)):  # reference in fp32
        qq, ee = q.to(cast).requires_grad_(), entry.to(cast).requires_grad_()
        out = fn(qq, ee, chosen, (192 + 64) ** -0.5, r)
        (out.float() * w.float()).sum().backward()  # same upstream gradient for both
        got.append((out.detach().float(), qq.grad.float(), ee.grad.float()))
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16 inputs, fp32 accumulation
    for want, have, name in zip(*got, ("out", "dq", "dentry")):
        err = float((have - want).abs().max()) / max(float(want.abs().max()), 1e-6)
        assert err <= tol, (name, dtype, err)


@needs_cuda
@pytest.mark.gpu
def test_fused_kernel_equals_reference_at_glm5_widths():
    _case(torch.bfloat16, t=256, s=3072, k=2048)


@needs_cuda
@pytest.mark.gpu
def test_fused_kernel_with_fewer_keys_than_topk():
    _case(torch.bfloat16, t=100, s=300, k=2048)  # 300 keys: -1 padding and a partial key block, same tuning


@needs_cuda
@pytest.mark.gpu
def test_float32_takes_the_torch_reference_on_cuda():
    from workers.models.blocks.dsa_fused import fused_applies

    assert not fused_applies(torch.zeros(1, device="cuda"))
    assert fused_applies(torch.zeros(1, device="cuda", dtype=torch.bfloat16))


@needs_cuda
@pytest.mark.gpu
def test_index_scores_bf16_tensor_cores_equal_the_float32_reference():
    from workers.models.blocks.dsa_kernels import index_scores, reference_scores

    g = torch.Generator(device="cuda").manual_seed(1)
    t, s, h, d, first = 512, 1536, 32, 128, 1024  # GLM-5's index heads and width
    q = torch.randn(1, t, h, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, s, d, device="cuda", generator=g).bfloat16()
    w = torch.rand(1, t, h, device="cuda", generator=g)
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference in IEEE float32
    got = index_scores(q, k, w, d ** -0.5, first)
    future = torch.arange(s, device="cuda")[None, :] > (first + torch.arange(t, device="cuda"))[:, None]
    want = reference_scores(q, k, w, d ** -0.5).masked_fill(future[None], float("-inf"))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    seen = ~torch.isinf(want)
    torch.testing.assert_close(got[seen], want[seen], rtol=1e-5, atol=1e-4)  # exact products: sums' order only
