"""The fused log-prob head: lm_head + log-softmax + log p(target) + entropy, chunked, with its own backward.

Why: the trainer needs only log p(target) [N] (with grad) and the entropy [N] (a metric) from the
vocabulary head, never the [N, V] logits. The checkpointed path (workers/models/blocks/logprobs.py,
``trainer.logprob_head=checkpoint``) bounds the logits to ``chunk x V`` but its backward re-runs the
whole forward under autograd (max, exp, sum, gather, the entropy products: ~a dozen fp32 passes
over ``chunk x V``, several kept alive at once) and then autograd's backward of each op.
This Function writes the gradient in closed form instead. For z = W h / T and p = softmax(z):

    d log p(y) / d z = onehot(y) - p        so    G = g * (onehot(y) - p) / T   per chunk,
    dh = G W,    dW = G^T h                  (g: the upstream gradient of log p, [N])

Forward, per chunk: one GEMM, then max / exp-sum / gather / entropy (on CUDA one Triton pass over
the compute-dtype logits, workers/models/blocks/logprob_kernels.py); it keeps only h, the targets
and each position's log-sum-exp ([N] floats). Backward, per chunk: the same GEMM again, p from the
saved log-sum-exp in place, G in place, two GEMMs. Peak extra memory is one ``chunk x V`` fp32
block (plus its compute-dtype copy) in either pass, and a float32 ``[V, H]`` accumulator for dW
when the weight is half precision (bf16 sums of many chunks would round away small updates; the
checkpointed path's autograd sums the chunks in the weight's dtype).

The values are those of ``workers.trainer.parallel.tensor.vocab_parallel_target_logprobs`` on the
full logits (the trainer's reference: logits in the compute dtype, upcast to float32, / T); the
unit test checks values and gradients of h and W against it. Vocabulary-parallel heads (TP: the
lm_head weight is a DTensor shard) keep the checkpointed path, whose scorer runs the all-reduces.

Liger-kernel's and cut-cross-entropy's fused linear cross-entropy were judged for this and not used:
Liger computes the gradient inside the forward assuming a scalar loss (our loss needs the per-token
gradient of log p through the importance ratios, known only in the backward) and returns no entropy;
cut-cross-entropy keeps the per-token backward but has no entropy output either and is not
installed in the GPU image. Neither handles the temperature-scaled sampling distribution.
"""
from __future__ import annotations

from typing import Optional

import torch

from workers.models.blocks import logprob_kernels

def fused_target_logprobs(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                          chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p [N] with grad to h and weight, entropy [N] no grad)`` of ``targets`` under
    ``softmax(h @ weight.T / temperature)`` for ``h`` [N, H], ``weight`` [V, H], ``chunk_tokens``
    positions at a time (0: all at once)."""
    assert temperature > 0, f"temperature must be > 0, got {temperature}"
    if h.shape[0] == 0:
        empty = h.new_zeros(0, dtype=torch.promote_types(h.dtype, torch.float32))
        return empty + (h.sum() + weight.sum()) * 0, empty
    chunk = chunk_tokens if chunk_tokens > 0 else h.shape[0]
    logp, entropy = _FusedLogprobs.apply(h, weight, targets, float(temperature), int(chunk))
    return logp, entropy


def _torch_grad(hc: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, lse: torch.Tensor, gc: torch.Tensor,
                temperature: float) -> torch.Tensor:
    """G = g (onehot(y) - softmax(z)) [c, V] in the GEMM dtype (``gc`` already divided by T)."""
    p = _chunk_logits(hc, weight, temperature)
    p.sub_(lse[:, None]).exp_()  # softmax, in place
    p.mul_(-gc[:, None])  # -g p
    p[torch.arange(hc.shape[0], device=p.device), y] += gc  # + g onehot(y)
    return p.to(weight.dtype)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 [n, V] logits / T, from a GEMM in the inputs' dtype (as the reference's lm_head)."""
    z = (h @ weight.t()).float()
    return z.div_(temperature) if temperature != 1.0 else z


def chunk_stats(hc: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, temperature: float
                ) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's forward: ``(logits, log p(y), entropy, lse)``, float32 ``[c]`` each; ``logits`` is the
    compute-dtype ``[c, V]`` block when the Triton kernels ran (reusable by :func:`chunk_grad_`), else
    None (the torch path consumed its float32 copy)."""
    if logprob_kernels.usable(hc):  # one read of the compute-dtype logits (logprob_kernels.py)
        z = hc @ weight.t()
        logp, entropy, lse = logprob_kernels.row_stats(z, y, temperature)
        return z, logp, entropy, lse
    z = _chunk_logits(hc, weight, temperature)  # [c, V] float32
    m = z.amax(-1)
    z_y = z.gather(-1, y[:, None]).squeeze(-1)
    z.sub_(m[:, None])  # z - m: <= 0
    e = torch.exp(z)
    s = e.sum(-1)
    pz = (e.mul_(z)).sum(-1)  # sum_v e_v (z_v - m)
    log_s = torch.log(s)
    # log p(y), entropy (log S - sum_v p_v (z_v - m)), lse
    return None, z_y - m - log_s, log_s - pz / s, m + log_s


def chunk_grad_(logits: Optional[torch.Tensor], hc: torch.Tensor, weight: torch.Tensor, y: torch.Tensor,
                lse: torch.Tensor, gc: torch.Tensor, temperature: float) -> torch.Tensor:
    """``G = g (onehot(y) - softmax)`` ``[c, V]`` in the GEMM dtype (``gc`` already divided by T), written
    over ``logits`` (the compute-dtype block of :func:`chunk_stats`) when given, else recomputed."""
    if logits is None and logprob_kernels.usable(hc):
        logits = hc @ weight.t()
    if logits is not None:  # G over the logits in place, in their dtype
        return logprob_kernels.row_grad_(logits, y, lse, gc, temperature)
    return _torch_grad(hc, weight, y, lse, gc, temperature)


_ADDMM_FP32: list = []
"""Whether ``torch.addmm(acc, a, b, out_dtype=float32, out=acc)`` sums a half-precision product into
a float32 accumulator correctly on this build (checked once, on CUDA only)."""


def _addmm_fp32_ok(device: torch.device) -> bool:
    if not _ADDMM_FP32:
        ok = False
        if device.type == "cuda":
            try:
                g = torch.Generator(device="cpu").manual_seed(0)
                a, b = (torch.randn(s, generator=g).to(device, torch.bfloat16) for s in ((64, 48), (48, 32)))
                acc = torch.ones(64, 32, device=device)
                torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
                ok = bool(torch.allclose(acc, 1 + a.float() @ b.float(), atol=1e-2, rtol=1e-2))
            except (RuntimeError, TypeError):
                ok = False
        _ADDMM_FP32.append(ok)
    return _ADDMM_FP32[0]


def accumulate_dw(dw: Optional[torch.Tensor], grad: torch.Tensor, hc: torch.Tensor, acc_dtype: torch.dtype
                  ) -> torch.Tensor:
    """``dw + grad^T hc`` (``dw`` None: the first chunk), summed in ``acc_dtype``. Half precision on
    CUDA: the GEMM writes float32 into the accumulator itself (no half-precision [V, H] product to
    write, read back and add: ~4 bytes x V x H less traffic a chunk)."""
    if dw is None:
        if acc_dtype != grad.dtype and _addmm_fp32_ok(grad.device):
            return torch.mm(grad.t(), hc, out_dtype=acc_dtype)
        return (grad.t() @ hc).to(acc_dtype)
    if dw.dtype == grad.dtype:
        return dw.addmm_(grad.t(), hc)
    if _addmm_fp32_ok(grad.device):
        return torch.addmm(dw, grad.t(), hc, out_dtype=dw.dtype, out=dw)
    return dw.add_(grad.t() @ hc)


class _FusedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk: int):
        n = h.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=h.device)
        entropy = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        for i in range(0, n, chunk):
            _z, logp[i:i + chunk], entropy[i:i + chunk], lse[i:i + chunk] = chunk_stats(
                h[i:i + chunk], weight, targets[i:i + chunk], temperature)
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp: Optional[torch.Tensor], _g_entropy):
        h, weight, targets, lse = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if g_logp is None or not (need_h or need_w):
            return None, None, None, None, None
        n = h.shape[0]
        g = g_logp.float() / t  # d z = d logits / T
        dh = torch.empty_like(h) if need_h else None
        acc_dtype = torch.promote_types(weight.dtype, torch.float32)
        dw = None
        for i in range(0, n, chunk):
            hc = h[i:i + chunk]
            grad = chunk_grad_(None, hc, weight, targets[i:i + chunk], lse[i:i + chunk], g[i:i + chunk], t)
            if need_h:
                dh[i:i + chunk] = grad @ weight
            if need_w:  # a GEMM in the compute dtype (fp32 inside), summed over chunks in fp32
                dw = accumulate_dw(dw, grad, hc, acc_dtype)
        if dw is not None and dw.dtype != weight.dtype:
            dw = dw.to(weight.dtype)
        return dh, dw, None, None, None
