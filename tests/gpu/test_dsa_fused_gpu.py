"""DSA's fused sparse-latent attention kernel compiled for the GPU (workers/models/blocks/dsa_fused.py),
against the torch reference at GLM-5's widths (latent 512 + rope 64, 64 heads, top-2048 keys): the CPU
tests run the same kernel under Triton's interpreter only at tiny widths, so the autotuned block sizes,
the atomics of the backward and bf16 inputs are checked here."""
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
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernel_equals_reference_at_glm5_widths(dtype):
    _case(dtype, t=256, s=3072, k=2048)


@needs_cuda
@pytest.mark.gpu
def test_fused_kernel_with_fewer_keys_than_topk_and_odd_heads():
    _case(torch.float32, t=100, s=300, k=2048, heads=17)
