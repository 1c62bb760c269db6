"""The log-prob head's Triton kernels compiled for the GPU (the CPU tests run them only under
Triton's interpreter) against the torch path, at a real vocabulary (Kimi-K2's 163,840) in bf16.

Skipped without CUDA (CI has none; results of the last run are in benchmarks/results/gpu/). Both
heads (two-pass ``fused`` and one-pass ``fused_loss``), temperature 1 (no division in the kernels)
and 0.7, gradients of the hidden states and of the weight.
"""
from __future__ import annotations

import pytest
import torch

from workers.models.blocks import logprob_kernels
from workers.models.blocks.fused_logprobs import fused_target_logprobs
from workers.models.blocks.fused_loss_head import fused_loss_logprobs

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none; see benchmarks/results/gpu)")


def _head(h, w, y, adv, t, one_pass: bool):
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    n = h.shape[0]
    fn = lambda lp, a, b: -(adv[a:b] * lp).sum() / n  # noqa: E731
    if one_pass:
        loss, logp, ent = fused_loss_logprobs(hh, ww, y, t, 96, fn)
    else:
        logp, ent = fused_target_logprobs(hh, ww, y, t, 96)
        loss = fn(logp, 0, n)
    (loss * 2.0).backward()  # an upstream gradient that is not 1: the backward's scale is exercised
    return [loss.detach(), logp.detach(), ent.detach(), hh.grad.float(), ww.grad.float()]


@needs_cuda
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("one_pass", [False, True])
def test_triton_head_equals_the_torch_path_on_cuda(monkeypatch, temperature, one_pass):
    g = torch.Generator().manual_seed(3)
    n, hidden, vocab = 256, 256, 163840
    h = (torch.randn(n, hidden, generator=g) * 0.5).cuda().bfloat16()
    w = (torch.randn(vocab, hidden, generator=g) * hidden ** -0.5).cuda().bfloat16()
    y = torch.randint(0, vocab, (n,), generator=g).cuda()
    adv = torch.randn(n, generator=g).cuda()
    assert logprob_kernels.usable(h)
    fast = _head(h, w, y, adv, temperature, one_pass)
    monkeypatch.setattr(logprob_kernels, "usable", lambda x: False)
    ref = _head(h, w, y, adv, temperature, one_pass)
    for name, a, b in zip(("loss", "logp", "entropy", "dh", "dw"), fast, ref):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3, msg=name)
