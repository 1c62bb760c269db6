"""Fused sparse-latent attention for DSA (Triton, forward and backward), and its torch reference.

Why: the torch path of GLM-5's sparse attention (workers/models/blocks/dsa_sparse.py) gathers each
query's chosen keys' MLA latents into a ``[B, C, K, r + dr]`` tensor (2048 x 576 values a query at
GLM-5's shapes: 2.4 MB of bf16 written and read again per token), takes float32 ``[B, H, C, K]``
scores and their softmax in separate passes, and its backward scatters the gathered latents'
gradient through a sort-based ``index_put``. Here one program takes one query token and a block of
its heads (a token's heads share its K chosen keys, so they are the matmul's M dimension):

* forward: it loads the chosen latents ``BLOCK_N`` keys at a time straight from ``entry`` by index
  (never materialised), scores ``q . [latent, k_rope] * scale`` in float32, keeps an online softmax
  (running max and sum, base 2) and accumulates ``p . latent`` into the ``[heads, r]`` output; it
  saves the max and the sum per (token, head), not the probabilities;
* backward: the same loop recomputes the probabilities from them, accumulates ``dq`` in registers
  (a program owns its token's heads: plain stores) and adds each chosen key's latent and rope
  gradient into a float32 ``[B, S, r + dr]`` buffer with atomics (a key is chosen by many queries).

Semantics are :func:`latent_reference`'s (the torch path's core, unchanged): ``q`` is already
absorbed (``[q_nope W_uk, q_rope]``); a ``-1`` index scores ``finfo(float32).min`` at key 0's
latent, so a query with nothing chosen averages key 0 (finite, as the reference), and no gradient
reaches the scores of ``-1`` entries. tests/unit/models/test_dsa_fused.py checks the output and
every gradient against the reference under Triton's CPU interpreter. Block sizes are autotuned on
CUDA (once per head count, top-k and widths); configurations that do not fit the card are skipped.
"""
from __future__ import annotations

import os

import torch

from workers.models.blocks.dsa_kernels import use_kernel

try:  # Triton ships with CUDA builds of torch; absent on CPU-only installs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None

FLOAT_MIN = torch.finfo(torch.float32).min


def latent_reference(q: torch.Tensor, entry: torch.Tensor, chosen: torch.Tensor, scale: float, r: int) -> torch.Tensor:
    """``q [B, H, C, r + dr]`` (absorbed queries), ``entry [B, S, r + dr]`` (normed latent, rotated
    shared key), ``chosen [B, C, K]`` int32 (-1: none) -> ``[B, H, C, r]``: the softmax over each
    query's chosen keys of ``q . key * scale``, weighted sum of their latents (gathered, in torch)."""
    batch = torch.arange(entry.shape[0], device=entry.device)[:, None, None]
    keys = entry[batch, chosen.clamp(min=0).long()]  # [B, C, K, r + dr]: one latent key per chosen position
    scores = torch.einsum("bhcx,bckx->bhck", q, keys).float() * scale
    # a finite floor, not -inf: a row with nothing chosen (a padded query) stays finite; chosen rows lose nothing
    scores = scores.masked_fill((chosen < 0)[:, None], FLOAT_MIN)
    return torch.einsum("bhck,bckr->bhcr", scores.softmax(-1).to(entry.dtype), keys[..., :r])


def fused_applies(q: torch.Tensor) -> bool:
    """The kernels apply: CUDA tensors and Triton (or ``TRITON_INTERPRET=1`` on CPU, for the tests)."""
    return use_kernel(q)


@torch.compiler.disable  # a user Triton kernel with autotuning: one graph break, as dsa_kernels.causal_topk
def sparse_latent_attention(q: torch.Tensor, entry: torch.Tensor, chosen: torch.Tensor, scale: float,
                            r: int) -> torch.Tensor:
    """:func:`latent_reference` fused (differentiable in ``q`` and ``entry``): ``[B, H, C, r]``."""
    return _SparseLatent.apply(q, entry, chosen, scale, r)


class _SparseLatent(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, entry, chosen, scale, r):
        o, m, l = _forward(q, entry, chosen, scale, r)
        ctx.save_for_backward(q, entry, chosen, o, m, l)
        ctx.scale, ctx.r = scale, r
        return o.permute(0, 2, 1, 3)  # [B, C, H, r] in memory: a token's heads contiguous

    @staticmethod
    def backward(ctx, grad):
        q, entry, chosen, o, m, l = ctx.saved_tensors
        dq, dentry = _backward(q, entry, chosen, o, m, l, grad.permute(0, 2, 1, 3), ctx.scale, ctx.r)
        return dq, dentry, None, None, None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _dims(q: torch.Tensor, entry: torch.Tensor, r: int) -> dict:
    dr = entry.shape[-1] - r
    return dict(R=r, DR=dr, BLOCK_R=max(triton.next_power_of_2(r), 16), BLOCK_DR=max(triton.next_power_of_2(dr), 16),
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32")


def _forward(q, entry, chosen, scale, r):
    b, h, c, _ = q.shape
    o = torch.empty(b, c, h, r, dtype=q.dtype, device=q.device)
    m = torch.empty(b, c, h, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    args = (q, entry, chosen, o, m, l, scale, h, chosen.shape[-1], *q.stride(), *entry.stride(), *chosen.stride(),
            *o.stride()[:3], *m.stride()[:2])
    if _interpreting():
        _fwd_kernel[(c, triton.cdiv(h, 16), b)](*args, **_dims(q, entry, r), BLOCK_H=16, BLOCK_N=16)
    else:
        _fwd_tuned[lambda meta: (c, triton.cdiv(h, meta["BLOCK_H"]), b)](*args, **_dims(q, entry, r))
    return o, m, l


def _backward(q, entry, chosen, o, m, l, grad, scale, r):
    """``grad [B, C, H, r]`` (any strides) -> ``dq`` like ``q``, ``dentry`` like ``entry``."""
    b, h, c, _ = q.shape
    delta = (grad.float() * o.float()).sum(-1).contiguous()  # [B, C, H]: rowsum(dO * O)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dkv = torch.zeros(entry.shape, dtype=torch.float32, device=entry.device)
    args = (q, entry, chosen, grad, m, l, delta, dq, dkv, scale, h, chosen.shape[-1], *q.stride(), *entry.stride(),
            *chosen.stride(), *grad.stride(), *m.stride()[:2], *dq.stride(), *dkv.stride())
    if _interpreting():
        _bwd_kernel[(c, triton.cdiv(h, 16), b)](*args, **_dims(q, entry, r), BLOCK_H=16, BLOCK_N=16)
    else:
        _bwd_tuned[lambda meta: (c, triton.cdiv(h, meta["BLOCK_H"]), b)](*args, **_dims(q, entry, r))
    return dq, dkv.to(entry.dtype)


if triton is not None:
    @triton.jit
    def _load_q(q_ptr, pid_b, pid_m, pid_h, n_h, sqb, sqh, sqm, sqd, R: tl.constexpr, DR: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_H: tl.constexpr):
        """A token's block of heads: offsets, masks, and its absorbed query ``[H, R]`` latent / ``[H, DR]`` rope."""
        offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_r, offs_e = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_DR)
        in_h, in_r, in_e = offs_h < n_h, offs_r < R, offs_e < DR
        q_row = q_ptr + pid_b * sqb + pid_m * sqm + offs_h[:, None] * sqh
        ql = tl.load(q_row + offs_r[None, :] * sqd, mask=in_h[:, None] & in_r[None, :], other=0.0)
        qe = tl.load(q_row + (R + offs_e[None, :]) * sqd, mask=in_h[:, None] & in_e[None, :], other=0.0)
        return offs_h, offs_r, offs_e, in_h, in_r, in_e, ql, qe

    @triton.jit
    def _key_block(ql, qe, idx_row, kv_b, start, n_k, sik, skn, skd, offs_r, offs_e, in_r, in_e, qk_scale,
                   R: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
        """``BLOCK_N`` chosen keys from ``start``: indices, gathered rows (latent ``[N, R]``, rope ``[N, DR]``)
        and base-2 scores ``[H, N]`` (``-1``: float32 min; past ``n_k``: -inf)."""
        offs_n = start + tl.arange(0, BLOCK_N)
        in_n = offs_n < n_k
        idx = tl.load(idx_row + offs_n * sik, mask=in_n, other=0)
        row = tl.maximum(idx, 0).to(tl.int64)[:, None]
        kl = tl.load(kv_b + row * skn + offs_r[None, :] * skd, mask=in_n[:, None] & in_r[None, :], other=0.0)
        ke = tl.load(kv_b + row * skn + (R + offs_e[None, :]) * skd, mask=in_n[:, None] & in_e[None, :], other=0.0)
        s = tl.dot(ql, tl.trans(kl), input_precision=PRECISION)
        s = tl.dot(qe, tl.trans(ke), s, input_precision=PRECISION)
        s = tl.where((idx >= 0)[None, :], s * qk_scale, -3.4028234663852886e38)
        s = tl.where(in_n[None, :], s, float("-inf"))
        return in_n, idx, row, kl, ke, s

    @triton.jit(do_not_specialize=["n_h", "n_k"])
    def _fwd_kernel(q_ptr, kv_ptr, idx_ptr, o_ptr, m_ptr, l_ptr, scale, n_h, n_k,
                    sqb, sqh, sqm, sqd, skb, skn, skd, sib, sim, sik, sob, som, soh, smb, smm,
                    R: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
                    PRECISION: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_m, pid_h, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_h, offs_r, offs_e, in_h, in_r, in_e, ql, qe = _load_q(q_ptr, pid_b, pid_m, pid_h, n_h, sqb, sqh, sqm, sqd,
                                                                   R, DR, BLOCK_R, BLOCK_DR, BLOCK_H)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
        qk_scale = scale * 1.4426950408889634  # base-2 softmax
        idx_row = idx_ptr + pid_b * sib + pid_m * sim
        kv_b = kv_ptr + pid_b * skb
        for start in range(0, n_k, BLOCK_N):
            in_n, idx, row, kl, ke, s = _key_block(ql, qe, idx_row, kv_b, start, n_k, sik, skn, skd, offs_r, offs_e,
                                                   in_r, in_e, qk_scale, R, PRECISION, BLOCK_N)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(kl.dtype), kl, acc * alpha[:, None], input_precision=PRECISION)
            m_i = m_new
        acc = acc / l_i[:, None]
        o_row = o_ptr + pid_b * sob + pid_m * som + offs_h[:, None] * soh
        tl.store(o_row + offs_r[None, :], acc.to(o_ptr.dtype.element_ty), mask=in_h[:, None] & in_r[None, :])
        tl.store(m_ptr + pid_b * smb + pid_m * smm + offs_h, m_i, mask=in_h)
        tl.store(l_ptr + pid_b * smb + pid_m * smm + offs_h, l_i, mask=in_h)

    @triton.jit(do_not_specialize=["n_h", "n_k"])
    def _bwd_kernel(q_ptr, kv_ptr, idx_ptr, do_ptr, m_ptr, l_ptr, delta_ptr, dq_ptr, dkv_ptr, scale, n_h, n_k,
                    sqb, sqh, sqm, sqd, skb, skn, skd, sib, sim, sik, sdob, sdom, sdoh, sdod, smb, smm,
                    sdqb, sdqh, sdqm, sdqd, sdkb, sdkn, sdkd,
                    R: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
                    PRECISION: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_m, pid_h, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_h, offs_r, offs_e, in_h, in_r, in_e, ql, qe = _load_q(q_ptr, pid_b, pid_m, pid_h, n_h, sqb, sqh, sqm, sqd,
                                                                   R, DR, BLOCK_R, BLOCK_DR, BLOCK_H)
        hr, he = in_h[:, None] & in_r[None, :], in_h[:, None] & in_e[None, :]
        do = tl.load(do_ptr + pid_b * sdob + pid_m * sdom + offs_h[:, None] * sdoh + offs_r[None, :] * sdod, mask=hr,
                     other=0.0)
        stat = pid_b * smb + pid_m * smm + offs_h
        m_i = tl.load(m_ptr + stat, mask=in_h, other=0.0)
        inv_l = 1.0 / tl.load(l_ptr + stat, mask=in_h, other=1.0)
        delta = tl.load(delta_ptr + stat, mask=in_h, other=0.0)
        none_chosen = (tl.max(tl.where(in_h, m_i, -3.4028234663852886e38), 0) == -3.4028234663852886e38).to(tl.int32)  # all -1: the reference averages key 0
        dql = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
        dqe = tl.zeros([BLOCK_H, BLOCK_DR], tl.float32)
        qk_scale = scale * 1.4426950408889634
        idx_row = idx_ptr + pid_b * sib + pid_m * sim
        kv_b, dkv_b = kv_ptr + pid_b * skb, dkv_ptr + pid_b * sdkb
        for start in range(0, n_k, BLOCK_N):
            in_n, idx, row, kl, ke, s = _key_block(ql, qe, idx_row, kv_b, start, n_k, sik, skn, skd, offs_r, offs_e,
                                                   in_r, in_e, qk_scale, R, PRECISION, BLOCK_N)
            valid = idx >= 0
            p = tl.where(in_h[:, None], tl.exp2(s - m_i[:, None]) * inv_l[:, None], 0.0)  # [H, N] probabilities
            dp = tl.dot(do, tl.trans(kl), input_precision=PRECISION)
            ds = tl.where(valid[None, :], p * (dp - delta[:, None]), 0.0).to(kl.dtype)  # d(scores) / scale
            dql = tl.dot(ds, kl, dql, input_precision=PRECISION)
            dqe = tl.dot(ds, ke, dqe, input_precision=PRECISION)
            dkl = tl.dot(tl.trans(ds), ql, input_precision=PRECISION) * scale
            dkl = tl.dot(tl.trans(p.to(kl.dtype)), do, dkl, input_precision=PRECISION)
            dke = tl.dot(tl.trans(ds), qe, input_precision=PRECISION) * scale
            put = in_n & (idx + none_chosen >= 0)  # a chosen key, or key 0 of a row with none
            tl.atomic_add(dkv_b + row * sdkn + offs_r[None, :] * sdkd, dkl, mask=put[:, None] & in_r[None, :],
                          sem="relaxed")
            tl.atomic_add(dkv_b + row * sdkn + (R + offs_e[None, :]) * sdkd, dke, mask=put[:, None] & in_e[None, :],
                          sem="relaxed")
        dq_row = dq_ptr + pid_b * sdqb + pid_m * sdqm + offs_h[:, None] * sdqh
        tl.store(dq_row + offs_r[None, :] * sdqd, (dql * scale).to(dq_ptr.dtype.element_ty), mask=hr)
        tl.store(dq_row + (R + offs_e[None, :]) * sdqd, (dqe * scale).to(dq_ptr.dtype.element_ty), mask=he)

    def _configs(shapes):
        return [triton.Config({"BLOCK_H": bh, "BLOCK_N": bn}, num_warps=w, num_stages=st) for bh, bn, w, st in shapes]

    _KEY = ["n_h", "n_k", "R", "DR"]
    _fwd_tuned = triton.autotune(_configs([(64, 32, 8, 1), (32, 64, 8, 1), (32, 32, 4, 2), (16, 64, 4, 2)]),
                                 key=_KEY)(_fwd_kernel)
    _bwd_tuned = triton.autotune(_configs([(64, 16, 8, 1), (32, 32, 8, 1), (32, 16, 4, 1), (16, 32, 4, 1)]),
                                 key=_KEY, reset_to_zero=["dkv_ptr"])(_bwd_kernel)
