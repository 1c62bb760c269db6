"""The fused log-prob head (workers/models/blocks/fused_logprobs.py) equals the reference scorer on the
full logits (values, entropy, gradients of h and of the head weight), in float32 and in bfloat16,
through the model's forward (``trainer.logprob_head=fused``), and never builds [N, V] at once."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import compose
from tests.helpers.triton_interpreter import assert_ok_under_interpreter
from workers.common.registry import MODELS
from workers.models.blocks import fused_logprobs
from workers.models.blocks.fused_logprobs import fused_target_logprobs
from workers.models.blocks.logprobs import Scoring
from workers.trainer.step import place, predicted
from workers.trainer.parallel.tensor import vocab_parallel_target_logprobs

torch.set_num_threads(1)


def reference(h, w, y, temperature):
    return vocab_parallel_target_logprobs(h @ w.t(), y, temperature, vocab_start=0, group=None)


def grads_of(fn, h, w, y, temperature, g):
    h = h.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    logp, ent = fn(h, w, y, temperature)
    (logp * g).sum().backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [0, 7, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_equals_reference_float32(chunk, temperature):
    gen = torch.Generator().manual_seed(1)
    n, hid, v = 29, 16, 97
    h, w = torch.randn(n, hid, generator=gen), torch.randn(v, hid, generator=gen) * 0.5
    y, g = torch.randint(0, v, (n,), generator=gen), torch.randn(n, generator=gen)
    ref = grads_of(reference, h, w, y, temperature, g)
    got = grads_of(lambda *a: fused_target_logprobs(*a, chunk_tokens=chunk), h, w, y, temperature, g)
    for name, a, b in zip(("logp", "entropy", "dh", "dw"), got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_fused_bfloat16_within_tolerance_of_reference():
    gen = torch.Generator().manual_seed(2)
    n, hid, v = 40, 32, 300
    h = torch.randn(n, hid, generator=gen).bfloat16()
    w = (torch.randn(v, hid, generator=gen) * 0.3).bfloat16()
    y, g = torch.randint(0, v, (n,), generator=gen), torch.randn(n, generator=gen)
    ref = grads_of(reference, h, w, y, 1.0, g)  # bf16 logits upcast: the trainer's path
    exact = grads_of(reference, h.float(), w.float(), y, 1.0, g)
    got = grads_of(lambda *a: fused_target_logprobs(*a, chunk_tokens=16), h, w, y, 1.0, g)
    assert got[2].dtype == torch.bfloat16 and got[3].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)  # same bf16 GEMM, same fp32 math
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)
    for a, b, e in ((got[2], ref[2], exact[2]), (got[3], ref[3], exact[3])):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
        # no further from the float32 truth than the reference's bf16 autograd is
        assert (a.float() - e).abs().max() <= 1.5 * (b.float() - e).abs().max() + 1e-3


def test_fused_never_builds_more_than_a_chunk_of_logits(monkeypatch):
    rows = []
    real = fused_logprobs._chunk_logits
    monkeypatch.setattr(fused_logprobs, "_chunk_logits", lambda h, w, t: rows.append(h.shape[0]) or real(h, w, t))
    h = torch.randn(50, 8, requires_grad=True)
    w = torch.randn(40, 8, requires_grad=True)
    logp, ent = fused_target_logprobs(h, w, torch.randint(0, 40, (50,)), 1.0, 16)
    assert not ent.requires_grad
    logp.sum().backward()
    assert max(rows) == 16 and sum(rows) == 100  # forward + backward recompute, 16 at a time


@pytest.mark.parametrize("preset", ["tiny_moe", "tiny_dense"])  # untied and tied lm_head
def test_model_fused_head_equals_checkpointed_head(preset):
    cfg = compose([f"model={preset}"]).model
    model = MODELS.get(cfg.family).init(cfg, torch.float32)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (3, 10), generator=gen)
    need = torch.ones_like(ids, dtype=torch.bool)
    need[:, -1] = False
    need[1, :4] = False
    at = predicted(need)
    wt = torch.randn(3, 10, generator=gen)

    def run(fused):
        model.zero_grad()
        score = Scoring(targets=ids[at], chunk_tokens=4, fused_temperature=0.7 if fused else None,
                        scorer=lambda z, y: vocab_parallel_target_logprobs(z, y, 0.7, vocab_start=0, group=None))
        out = model(ids, logits_mask=need, score=score)
        logp = place(at, out.logp)
        (logp * wt).sum().backward()
        return logp.detach(), out.entropy, {n: p.grad.clone() for n, p in model.named_parameters()}

    ref_logp, ref_ent, ref_grads = run(False)
    logp, ent, grads = run(True)
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(ent, ref_ent)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=name)


def test_empty_selection_still_reaches_the_weights():
    h = torch.randn(0, 8, requires_grad=True)
    w = torch.randn(40, 8, requires_grad=True)
    logp, ent = fused_target_logprobs(h, w, torch.zeros(0, dtype=torch.long), 1.0, 16)
    logp.sum().backward()
    assert logp.shape == (0,) and w.grad is not None and float(w.grad.abs().sum()) == 0.0


KERNEL_SCRIPT = """
import torch
from workers.models.blocks import logprob_kernels
from workers.models.blocks.fused_logprobs import fused_target_logprobs
assert logprob_kernels.usable(torch.zeros(1))
logprob_kernels.BLOCK_V = 64  # several tiles a row, the last one partial
g = torch.Generator().manual_seed(5)
for dtype, v, t in ((torch.float32, 150, 0.7), (torch.bfloat16, 300, 1.0)):
    h = torch.randn(21, 16, generator=g).to(dtype)
    w = (torch.randn(v, 16, generator=g) * 2).to(dtype)
    y, up = torch.randint(0, v, (21,), generator=g), torch.randn(21, generator=g)
    outs = []
    for kernel in (True, False):
        logprob_kernels.usable = (lambda x: True) if kernel else (lambda x: False)
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        logp, ent = fused_target_logprobs(hh, ww, y, t, 8)
        (logp * up).sum().backward()
        outs.append((logp, ent, hh.grad.float(), ww.grad.float()))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
print("ok")
"""


def test_triton_row_kernels_under_the_interpreter_equal_the_torch_path():
    assert_ok_under_interpreter(KERNEL_SCRIPT)