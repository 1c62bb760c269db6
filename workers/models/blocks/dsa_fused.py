"""Fused sparse-latent attention for DSA (Triton, forward and backward), and its torch reference.

Why: the torch path of GLM-5's sparse attention (workers/models/blocks/dsa_sparse.py) gathers each
query's chosen keys' MLA latents into a ``[B, C, K, r + dr]`` tensor (2048 x 576 values a query at
GLM-5's shapes: 2.4 MB of bf16 written and read again per token), takes float32 ``[B, H, C, K]``
scores and their softmax in separate passes, and its backward scatters the gathered latents'
gradient through a sort-based ``index_put``. Here one program takes one query token and a block of
its heads (a token's heads share its K chosen keys, so they are the matmul's M dimension):

* forward: it loads the chosen latents ``BLOCK_N`` keys at a time straight from ``entry`` by index
  (each key's row is ``r + dr`` contiguous values: coalesced; never materialised), scores
  ``q . [latent, k_rope] * scale`` as a sum of tensor-core dots over 64-wide column chunks (M = 64
  heads, float32 accumulation; only one chunk of queries and keys live at a time), keeps an online
  softmax (running max and sum, base 2) and accumulates ``p . latent`` into a float32 ``[heads,
  BLOCK_O]`` output (``BLOCK_O`` 512: every latent column; 256: two programs a token, half the
  registers, every score computed twice); it saves the max and the sum per (token, head);
* backward: the same loop recomputes the probabilities from them, ``dO . latent`` chunked as the
  scores, accumulates ``dq`` in registers (a program owns its token's heads: plain stores) and adds
  each chosen key's ``[latent, k_rope]`` gradient, 64 columns at a time, into a float32
  ``[B, S, r + dr]`` buffer with atomics on ``[BLOCK_N, 64]`` tiles (a key is chosen by many queries).

Semantics are :func:`latent_reference`'s (the torch path's core, unchanged): ``q`` is already
absorbed (``[q_nope W_uk, q_rope]``); a ``-1`` index scores ``finfo(float32).min`` at key 0's
latent, so a query with nothing chosen averages key 0 (finite, as the reference), and no gradient
reaches the scores of ``-1`` entries. tests/unit/models/test_dsa_fused.py checks the output and
every gradient against the reference under Triton's CPU interpreter. Block sizes are autotuned on
CUDA among three or four configurations per pass (once per head count, widths and dtype; never per top-k or
chunk length); bf16/fp16 only there (:func:`fused_applies`: float32 takes the torch reference)."""
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
    """The kernels apply: bf16/fp16 CUDA tensors and Triton (or ``TRITON_INTERPRET=1`` on CPU, any dtype,
    for the tests). float32 on CUDA takes the torch reference: IEEE float32 dots run on no tensor core
    and their [64, 512] tiles spill, so the kernel would be slower than the gathers and compile slowly."""
    return use_kernel(q) and (_interpreting() or q.dtype in (torch.bfloat16, torch.float16))


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
    return dict(R=r, W=entry.shape[-1], BLOCK_R=max(triton.next_power_of_2(r), 16),
                BLOCK_DR=max(triton.next_power_of_2(entry.shape[-1] - r), 16),
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32")  # tf32: ignored by bf16/fp16 dots


def _interpreter_blocks(r: int) -> dict:
    """Small blocks for Triton's CPU interpreter (the tests); the output split in two where ``r`` allows,
    so the tests cover a program owning part of the latent output."""
    return dict(BLOCK_H=16, BLOCK_N=16, BLOCK_D=16, BLOCK_O=max(16, triton.next_power_of_2(r) // 2))


def _forward(q, entry, chosen, scale, r):
    b, h, c, _ = q.shape
    o = torch.empty(b, c, h, r, dtype=q.dtype, device=q.device)
    m = torch.empty(b, c, h, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    args = (q, entry, chosen, o, m, l, scale, h, chosen.shape[-1], *q.stride(), *entry.stride(), *chosen.stride(),
            *o.stride()[:3], *m.stride()[:2])

    def grid(meta):  # axis 1: head blocks x slices of the latent output
        return c, triton.cdiv(h, meta["BLOCK_H"]) * triton.cdiv(r, meta["BLOCK_O"]), b

    if _interpreting():
        _fwd_kernel[grid(_interpreter_blocks(r))](*args, **_dims(q, entry, r), **_interpreter_blocks(r))
    else:
        _fwd_tuned[grid](*args, **_dims(q, entry, r))
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
        blocks = _interpreter_blocks(r)
        del blocks["BLOCK_O"]
        _bwd_kernel[(c, triton.cdiv(h, 16), b)](*args, **_dims(q, entry, r), **blocks)
    else:
        _bwd_tuned[lambda meta: (c, triton.cdiv(h, meta["BLOCK_H"]), b)](*args, **_dims(q, entry, r))
    return dq, dkv.to(entry.dtype)


if triton is not None:
    @triton.jit
    def _keys(idx_row, kv_b, start, n_k, sik, skn, BLOCK_N: tl.constexpr):
        """``BLOCK_N`` chosen keys from ``start``: in range, their indices, and their rows' pointers ``[N, 1]``."""
        offs_n = start + tl.arange(0, BLOCK_N)
        in_n = offs_n < n_k
        idx = tl.load(idx_row + offs_n * sik, mask=in_n, other=0)
        return in_n, idx, kv_b + tl.maximum(idx, 0).to(tl.int64)[:, None] * skn

    @triton.jit
    def _scores(q_rows, sqd, k_rows, skd, in_h, in_n, idx, qk_scale, W: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """Base-2 scores ``[H, N]`` of the heads' absorbed queries against the keys' ``[latent, k_rope]``
        rows, a sum of dots over ``BLOCK_D``-wide column chunks (few registers live; the queries' chunks
        are re-read from L1/L2, each key row's chunk is contiguous). ``-1``: float32 min; past ``n_k``: -inf."""
        s = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
        offs_d = tl.arange(0, BLOCK_D)
        for c in tl.static_range(0, W, BLOCK_D):
            in_c = (c + offs_d) < W
            qc = tl.load(q_rows + (c + offs_d)[None, :] * sqd, mask=in_h[:, None] & in_c[None, :], other=0.0)
            kc = tl.load(k_rows + (c + offs_d)[None, :] * skd, mask=in_n[:, None] & in_c[None, :], other=0.0)
            s = tl.dot(qc, tl.trans(kc), s, input_precision=PRECISION)
        s = tl.where((idx >= 0)[None, :], s * qk_scale, -3.4028234663852886e38)
        return tl.where(in_n[None, :], s, float("-inf"))

    @triton.jit(do_not_specialize=["n_h", "n_k"])
    def _fwd_kernel(q_ptr, kv_ptr, idx_ptr, o_ptr, m_ptr, l_ptr, scale, n_h, n_k,
                    sqb, sqh, sqm, sqd, skb, skn, skd, sib, sim, sik, sob, som, soh, smb, smm,
                    R: tl.constexpr, W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
                    PRECISION: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_O: tl.constexpr):
        """One token, ``BLOCK_H`` heads, ``BLOCK_O`` of the ``R`` latent output columns (axis 1 of the grid:
        head block x output slice): online softmax over the chosen keys, ``BLOCK_N`` at a time."""
        pid_m, pid_ho, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n_o = tl.cdiv(R, BLOCK_O)
        pid_h, pid_o = pid_ho // n_o, pid_ho % n_o
        offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        in_h = offs_h < n_h
        offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
        in_o = offs_o < R
        q_rows = q_ptr + pid_b * sqb + pid_m * sqm + offs_h[:, None] * sqh
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_O], tl.float32)
        qk_scale = scale * 1.4426950408889634  # base-2 softmax
        idx_row = idx_ptr + pid_b * sib + pid_m * sim
        kv_b = kv_ptr + pid_b * skb
        for start in range(0, n_k, BLOCK_N):
            in_n, idx, k_rows = _keys(idx_row, kv_b, start, n_k, sik, skn, BLOCK_N)
            s = _scores(q_rows, sqd, k_rows, skd, in_h, in_n, idx, qk_scale, W, PRECISION, BLOCK_H, BLOCK_N, BLOCK_D)
            v = tl.load(k_rows + offs_o[None, :] * skd, mask=in_n[:, None] & in_o[None, :], other=0.0)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
            m_i = m_new
        acc = acc / l_i[:, None]
        o_row = o_ptr + pid_b * sob + pid_m * som + offs_h[:, None] * soh
        tl.store(o_row + offs_o[None, :], acc.to(o_ptr.dtype.element_ty), mask=in_h[:, None] & in_o[None, :])
        first = in_h & ((offs_h * 0 + pid_o) == 0)  # every output slice has the same statistics: the first stores them
        tl.store(m_ptr + pid_b * smb + pid_m * smm + offs_h, m_i, mask=first)
        tl.store(l_ptr + pid_b * smb + pid_m * smm + offs_h, l_i, mask=first)

    @triton.jit(do_not_specialize=["n_h", "n_k"])
    def _bwd_kernel(q_ptr, kv_ptr, idx_ptr, do_ptr, m_ptr, l_ptr, delta_ptr, dq_ptr, dkv_ptr, scale, n_h, n_k,
                    sqb, sqh, sqm, sqd, skb, skn, skd, sib, sim, sik, sdob, sdom, sdoh, sdod, smb, smm,
                    sdqb, sdqh, sdqm, sdqd, sdkb, sdkn, sdkd,
                    R: tl.constexpr, W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
                    PRECISION: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """One token, ``BLOCK_H`` heads: recomputed probabilities, ``dq`` in registers (plain stores), and
        each key block's ``[latent, k_rope]`` gradient added ``BLOCK_D`` columns at a time (float32 atomics)."""
        pid_m, pid_h, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_r, offs_e, offs_d = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_DR), tl.arange(0, BLOCK_D)
        in_h, in_r, in_e = offs_h < n_h, offs_r < R, offs_e < W - R
        q_rows = q_ptr + pid_b * sqb + pid_m * sqm + offs_h[:, None] * sqh
        do_rows = do_ptr + pid_b * sdob + pid_m * sdom + offs_h[:, None] * sdoh
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
            in_n, idx, k_rows = _keys(idx_row, kv_b, start, n_k, sik, skn, BLOCK_N)
            s = _scores(q_rows, sqd, k_rows, skd, in_h, in_n, idx, qk_scale, W, PRECISION, BLOCK_H, BLOCK_N, BLOCK_D)
            p = tl.where(in_h[:, None], tl.exp2(s - m_i[:, None]) * inv_l[:, None], 0.0)  # [H, N] probabilities
            kl = tl.load(k_rows + offs_r[None, :] * skd, mask=in_n[:, None] & in_r[None, :], other=0.0)
            ke = tl.load(k_rows + (R + offs_e[None, :]) * skd, mask=in_n[:, None] & in_e[None, :], other=0.0)
            dp = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)  # dO . latent, chunked as the scores
            for c in tl.static_range(0, R, BLOCK_D):
                in_c = (c + offs_d) < R
                doc = tl.load(do_rows + (c + offs_d)[None, :] * sdod, mask=in_h[:, None] & in_c[None, :], other=0.0)
                vc = tl.load(k_rows + (c + offs_d)[None, :] * skd, mask=in_n[:, None] & in_c[None, :], other=0.0)
                dp = tl.dot(doc, tl.trans(vc), dp, input_precision=PRECISION)
            ds = tl.where((idx >= 0)[None, :], p * (dp - delta[:, None]), 0.0).to(kl.dtype)  # d(scores) / scale
            dql = tl.dot(ds, kl, dql, input_precision=PRECISION)
            dqe = tl.dot(ds, ke, dqe, input_precision=PRECISION)
            put = in_n & (idx + none_chosen >= 0)  # a chosen key, or key 0 of a row with none
            dk_rows = dkv_b + tl.maximum(idx, 0).to(tl.int64)[:, None] * sdkn
            pt = tl.trans(p.to(kl.dtype))
            for c in tl.static_range(0, W, BLOCK_D):  # d[latent, k_rope] = ds^T q * scale (+ p^T dO on the latent)
                in_c = (c + offs_d) < W
                qc = tl.load(q_rows + (c + offs_d)[None, :] * sqd, mask=in_h[:, None] & in_c[None, :], other=0.0)
                dk = tl.dot(tl.trans(ds), qc, input_precision=PRECISION) * scale
                if c < R:
                    lat = (c + offs_d) < R
                    doc = tl.load(do_rows + (c + offs_d)[None, :] * sdod, mask=in_h[:, None] & lat[None, :],
                                  other=0.0)
                    dk = tl.dot(pt, doc, dk, input_precision=PRECISION)
                tl.atomic_add(dk_rows + (c + offs_d)[None, :] * sdkd, dk, mask=put[:, None] & in_c[None, :],
                              sem="relaxed")
        dq_row = dq_ptr + pid_b * sdqb + pid_m * sdqm + offs_h[:, None] * sdqh
        tl.store(dq_row + offs_r[None, :] * sdqd, (dql * scale).to(dq_ptr.dtype.element_ty),
                 mask=in_h[:, None] & in_r[None, :])
        tl.store(dq_row + (R + offs_e[None, :]) * sdqd, (dqe * scale).to(dq_ptr.dtype.element_ty),
                 mask=in_h[:, None] & in_e[None, :])

    # A handful of Hopper configurations each (tuned once per head count, widths and dtype; float32 inputs
    # never reach them on CUDA: fused_applies routes those to the torch reference). Forward: a [64, 512]
    # float32 accumulator is 128 registers a thread at 8 warps; BLOCK_O 256 halves it at the price of
    # computing every score twice (two programs per token). Backward: dq's [H, 512] accumulator stays in
    # registers; BLOCK_H 32 halves it at the price of twice the key-gradient atomics. One configuration of
    # each has no software pipelining (num_stages 1): little shared memory, so one always compiles.
    def _configs(names, shapes):
        return [triton.Config(dict(zip(names, shape[:-2])), num_warps=shape[-2], num_stages=shape[-1])
                for shape in shapes]

    _KEY = ["n_h", "R", "W"]
    _fwd_tuned = triton.autotune(_configs(("BLOCK_H", "BLOCK_N", "BLOCK_O", "BLOCK_D"),
                                          [(64, 64, 512, 64, 8, 2), (64, 64, 256, 64, 8, 2), (64, 32, 512, 64, 8, 3),
                                           (64, 32, 256, 64, 8, 1)]),
                                 key=_KEY)(_fwd_kernel)
    _bwd_tuned = triton.autotune(_configs(("BLOCK_H", "BLOCK_N", "BLOCK_D"),
                                          [(64, 32, 64, 8, 2), (64, 64, 64, 8, 1), (32, 64, 64, 8, 2)]),
                                 key=_KEY, reset_to_zero=["dkv_ptr"])(_bwd_kernel)
