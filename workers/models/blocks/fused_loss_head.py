"""The fused log-prob head with the loss's gradient taken in its forward: three GEMMs over the
vocabulary instead of four (``trainer.logprob_head=fused_loss``).

Why: the fused head (workers/models/blocks/fused_logprobs.py) never keeps ``[N, V]`` logits, so its
backward computes each chunk's logits a second time before the two gradient GEMMs: 4 GEMMs of
``N x H x V`` where a head that keeps its logits needs 3. At the real shapes of issue 36 (hidden 2048,
152k / 164k vocabularies) those GEMMs are most of the step's FLOPs, and the recompute alone is about
as long as a whole MoE layer's forward. When the loss is a sum of per-token terms (the trainer's
policy loss at ``ratio_level=token`` without an entropy bonus; cross-entropy), the gradient of each
position's log-prob depends on that position alone, so it is known as soon as the chunk's log-prob
is: this head scores a chunk, asks ``token_loss`` for its terms and their gradient (autograd on the
chunk's ``[c]`` log-probs: the loss code itself, not a copy of its derivative), turns the logits
block into ``G = g (onehot(y) - p) / T`` in place and runs the two gradient GEMMs right away.

What it keeps from the forward to the backward: ``dh`` ``[N, H]`` (the hidden states' gradient, the
size of the hidden states the other head keeps instead) and the weight's gradient, float32
``[V, H]`` (1.2 GiB at 152k x 2048; the other head allocates it in the backward). The backward only
scales them by the upstream gradient of the returned loss. The returned log-probs and entropies
carry no gradient: everything the loss needs from them went through ``token_loss``.

Exactness: ``sum over chunks of token_loss`` is the loss, and each chunk's gradient is the one
autograd takes through the two-pass head; tests/unit/models/test_fused_loss_head.py compares loss,
log-probs and the gradients of h and W with the two-pass head on the same batch.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from workers.models.blocks import logprob_kernels
from workers.models.blocks.fused_logprobs import accumulate_dw, chunk_grad_, chunk_stats

TokenLoss = Callable[[torch.Tensor, int, int], torch.Tensor]
"""``token_loss(logp [c] (requires grad), a, b)`` -> the scalar loss terms of scored positions
``a .. b-1`` (``logp`` is theirs). Summed over chunks it is the whole loss; it may only combine each
position's log-prob with that position's own inputs (and global constants such as normalisers)."""


def fused_loss_logprobs(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                        chunk_tokens: int, token_loss: TokenLoss
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss scalar with grad to h and weight, log p [N] no grad, entropy [N] no grad)`` of
    ``targets`` under ``softmax(h @ weight.T / temperature)`` (``h`` [N, H], ``weight`` [V, H]), the
    loss being ``sum over chunks of token_loss``; ``chunk_tokens`` positions at a time (0: all)."""
    assert temperature > 0, f"temperature must be > 0, got {temperature}"
    chunk = chunk_tokens if chunk_tokens > 0 else max(1, h.shape[0])
    return _FusedLossHead.apply(h, weight, targets, float(temperature), int(chunk), token_loss)


def _chunk_loss_grad(token_loss: TokenLoss, logp: torch.Tensor, a: int, b: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the chunk's loss value, d loss / d logp [c] float32) by autograd through ``token_loss``."""
    with torch.enable_grad():
        lp = logp.detach().clone().requires_grad_(True)
        loss = token_loss(lp, a, b)
        if not loss.requires_grad:  # every term masked out: no gradient
            return loss.detach().float(), torch.zeros_like(lp)
        (g,) = torch.autograd.grad(loss, lp, allow_unused=True)
    return loss.detach().float(), (torch.zeros_like(lp) if g is None else g.float())


class _FusedLossHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float, chunk: int,
                token_loss: TokenLoss):
        n = h.shape[0]
        logp = torch.zeros(n, dtype=torch.float32, device=h.device)
        entropy = torch.zeros_like(logp)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        need_h, need_w = h.requires_grad, weight.requires_grad
        dh = torch.empty_like(h) if need_h else None  # every row is written, chunk by chunk
        acc_dtype = torch.promote_types(weight.dtype, torch.float32)
        dw: Optional[torch.Tensor] = None
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            hc, y = h[a:b], targets[a:b]
            z, logp[a:b], entropy[a:b], lse = chunk_stats(hc, weight, y, temperature)
            loss, g = _chunk_loss_grad(token_loss, logp[a:b], a, b)
            total += loss
            if not (need_h or need_w):
                continue
            grad = chunk_grad_(z, hc, weight, y, lse, g / temperature, temperature)  # G, over z in place
            if need_h:
                torch.mm(grad, weight, out=dh[a:b])  # a contiguous row block of dh: no temporary
            if need_w:
                dw = accumulate_dw(dw, grad, hc, acc_dtype)
        if need_w and dw is None:
            dw = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device)
        ctx.save_for_backward(*(t for t in (dh, dw) if t is not None))
        ctx.has = (need_h, need_w)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(logp, entropy)
        return total, logp, entropy

    @staticmethod
    def backward(ctx, g_total: torch.Tensor, _g_logp, _g_entropy):
        saved = list(ctx.saved_tensors)
        need_h, need_w = ctx.has
        dh = saved.pop(0) if need_h else None
        dw = saved.pop(0) if need_w else None
        scale = g_total.float()  # usually 1 (loss.backward()); multiplied, not tested: no host read
        fast = logprob_kernels.usable(scale)  # one pass each, the scale read on the device
        if dh is not None:
            dh = logprob_kernels.round_scaled(dh, scale, dh.dtype) if fast and dh.is_contiguous() else dh * scale
        if dw is not None and fast and dw.is_contiguous():
            dw = logprob_kernels.round_scaled(dw, scale, ctx.weight_dtype)
        elif dw is not None:  # rounded first (a new tensor), then scaled in place: a bf16 pass, not a float32 one
            dw = dw.to(ctx.weight_dtype).mul_(scale) if dw.dtype != ctx.weight_dtype else dw * scale
        return dh, dw, None, None, None, None
