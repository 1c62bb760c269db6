"""The loss-in-forward head (workers/models/blocks/fused_loss_head.py, ``trainer.logprob_head=fused_loss``)
equals the two-pass fused head followed by the same loss: loss value, log-probs, entropy and the
gradients of h and of the head weight, in float32 and bfloat16, on the torch path and on the Triton
row kernels (CPU interpreter), through the model's forward; and it runs one GEMM fewer."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import compose
from tests.helpers.triton_interpreter import assert_ok_under_interpreter
from workers.common.registry import MODELS
from workers.models.blocks import fused_logprobs
from workers.models.blocks.fused_logprobs import fused_target_logprobs
from workers.models.blocks.fused_loss_head import fused_loss_logprobs
from workers.models.blocks.logprobs import Scoring
from workers.trainer.step import place, predicted

torch.set_num_threads(1)


def policy_like(old: torch.Tensor, adv: torch.Tensor, norm: float):
    """A per-token loss with the trainer's shape: a clipped importance weight (detached) times the
    advantage times log p, one masked position, a global normaliser."""
    def loss(lp: torch.Tensor, a: int, b: int) -> torch.Tensor:
        w = torch.exp(lp.detach() - old[a:b]).clamp(max=1.5)
        keep = torch.ones_like(lp, dtype=torch.bool)
        if a <= 3 < b:
            keep[3 - a] = False
        return -torch.where(keep, w * adv[a:b] * lp, torch.zeros_like(lp)).sum() / norm
    return loss


def both(h, w, y, temperature, chunk, token_loss):
    """(two-pass: loss, logp, entropy, dh, dw), (one-pass: the same)."""
    out = []
    for one_pass in (False, True):
        hh, ww = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
        if one_pass:
            loss, logp, ent = fused_loss_logprobs(hh, ww, y, temperature, chunk, token_loss)
            assert not logp.requires_grad and not ent.requires_grad
        else:
            logp, ent = fused_target_logprobs(hh, ww, y, temperature, chunk)
            loss = token_loss(logp, 0, len(y))
        loss.backward()
        out.append((loss.detach().float(), logp.detach(), ent.detach(), hh.grad.float(), ww.grad.float()))
    return out


@pytest.mark.parametrize("chunk", [0, 7, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_one_pass_equals_two_pass_float32(chunk, temperature):
    gen = torch.Generator().manual_seed(1)
    n, hid, v = 29, 16, 97
    h, w = torch.randn(n, hid, generator=gen), torch.randn(v, hid, generator=gen) * 0.5
    y = torch.randint(0, v, (n,), generator=gen)
    loss = policy_like(torch.randn(n, generator=gen) - 3, torch.randn(n, generator=gen), norm=n)
    two, one = both(h, w, y, temperature, chunk, loss)
    for name, a, b in zip(("loss", "logp", "entropy", "dh", "dw"), one, two):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert float(two[3].abs().sum()) > 0


def test_one_pass_bfloat16_and_upstream_scale():
    gen = torch.Generator().manual_seed(2)
    n, hid, v = 40, 32, 300
    h = torch.randn(n, hid, generator=gen).bfloat16()
    w = (torch.randn(v, hid, generator=gen) * 0.3).bfloat16()
    y = torch.randint(0, v, (n,), generator=gen)
    ce = lambda lp, a, b: -lp.sum() / n  # noqa: E731 (token-mean cross-entropy, the benchmark's loss)
    two, one = both(h, w, y, 1.0, 16, ce)
    torch.testing.assert_close(one[0], two[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(one[3:], two[3:]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss, _, _ = fused_loss_logprobs(hh, ww, y, 1.0, 16, ce)
    (3 * loss).backward()  # the upstream gradient scales both
    torch.testing.assert_close(hh.grad.float(), 3 * one[3], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ww.grad.float(), 3 * one[4], rtol=2e-2, atol=2e-2)


def test_one_pass_runs_three_gemms_not_four(monkeypatch):
    """The torch path recomputes logits only for the gradient; count head GEMMs by their shapes."""
    calls = []
    real = fused_logprobs._chunk_logits
    monkeypatch.setattr(fused_logprobs, "_chunk_logits", lambda h, w, t: calls.append(h.shape[0]) or real(h, w, t))
    h = torch.randn(50, 8, requires_grad=True)
    w = torch.randn(40, 8, requires_grad=True)
    y = torch.randint(0, 40, (50,))
    loss, _, _ = fused_loss_logprobs(h, w, y, 1.0, 16, lambda lp, a, b: -lp.sum())
    forward_calls = len(calls)
    loss.backward()
    assert len(calls) == forward_calls, "the backward computes no logits"
    assert h.grad is not None and w.grad is not None


def test_empty_selection():
    h = torch.randn(0, 8, requires_grad=True)
    w = torch.randn(40, 8, requires_grad=True)
    loss, logp, _ = fused_loss_logprobs(h, w, torch.zeros(0, dtype=torch.long), 1.0, 16, lambda lp, a, b: lp.sum())
    loss.backward()
    assert logp.shape == (0,) and float(w.grad.abs().sum()) == 0.0


@pytest.mark.parametrize("preset", ["tiny_moe", "tiny_dense"])  # untied and tied lm_head
def test_model_head_loss_equals_loss_of_logprobs(preset):
    cfg = compose([f"model={preset}"]).model
    model = MODELS.get(cfg.family).init(cfg, torch.float32)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (3, 10), generator=gen)
    need = torch.ones_like(ids, dtype=torch.bool)
    need[:, -1] = False
    need[1, :4] = False
    at = predicted(need)
    n = int(at.sum())
    loss_fn = policy_like(torch.randn(n, generator=gen) - 3, torch.randn(n, generator=gen), norm=n)

    def run(one_pass):
        model.zero_grad()
        score = Scoring(targets=ids[at], chunk_tokens=4, fused_temperature=0.7, scorer=None,
                        token_loss=loss_fn if one_pass else None)
        out = model(ids, logits_mask=need, score=score)
        loss = out.head_loss if one_pass else loss_fn(out.logp, 0, n)
        assert (out.head_loss is not None) == one_pass
        loss.backward()
        return loss.detach(), place(at, out.logp.detach()), {k: p.grad.clone() for k, p in model.named_parameters()}

    ref_loss, ref_logp, ref_grads = run(False)
    loss, logp, grads = run(True)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(logp, ref_logp)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


KERNEL_SCRIPT = """
import torch
from workers.models.blocks import logprob_kernels
from workers.models.blocks.fused_logprobs import fused_target_logprobs
from workers.models.blocks.fused_loss_head import fused_loss_logprobs
assert logprob_kernels.usable(torch.zeros(1))
logprob_kernels.BLOCK_V = 64
g = torch.Generator().manual_seed(5)
for dtype, v, t in ((torch.float32, 150, 0.7), (torch.bfloat16, 300, 1.0)):
    h = torch.randn(21, 16, generator=g).to(dtype)
    w = (torch.randn(v, 16, generator=g) * 2).to(dtype)
    y, adv = torch.randint(0, v, (21,), generator=g), torch.randn(21, generator=g)
    fn = lambda lp, a, b: -(adv[a:b] * lp).sum() / 21
    outs = []
    for one_pass in (True, False):
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        if one_pass:
            loss, logp, ent = fused_loss_logprobs(hh, ww, y, t, 8, fn)
        else:
            logp, ent = fused_target_logprobs(hh, ww, y, t, 8)
            loss = fn(logp, 0, 21)
        (loss * 2.0).backward()  # an upstream gradient that is not 1: the backward's one-pass scale runs
        outs.append((loss.detach(), logp.detach(), ent, hh.grad.float(), ww.grad.float()))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
print("ok")
"""


def test_one_pass_on_the_triton_row_kernels_under_the_interpreter():
    assert_ok_under_interpreter(KERNEL_SCRIPT)
