"""Grouped-query attention of one token per row over the static cache, as one Triton kernel (issue 45).

Why: in the static engine's decode step the attention went through SDPA with an additive mask, so
it ran PyTorch's memory-efficient (cutlass) kernel, built for long query blocks: on an H100 it took
~25 us a layer at SmolLM2-135M's shapes (128 rows, 9 heads over 3 kv heads of 64) and ~45 us at
Qwen3-30B-A3B's (32 over 4 of 128), where reading the rows' keys and values takes a few
microseconds: 30 % of SmolLM2's decode step, and the largest per-layer cost of a MoE decode layer
after its experts (what fp8 cannot shrink).

Here one program takes one row and one kv head: its ``g`` query heads (padded to 16, the tensor
cores' smallest tile) against the row's keys in blocks of ``BLOCK_N``, with an online softmax
(running max and sum in float32, each block's probabilities rounded to the cache's dtype for
the ``p @ v`` product, as flash attention does; float32 caches multiply in IEEE float32). Keys and values are read in place from the cache
slots (``[B, window, kv_heads, D]`` views, any row / position / head strides); the mask is the
forward's additive ``[B, window]`` row (0 seen, -inf not: the causal end and a sliding window). A
row that sees no key gives zeros (SDPA gives NaN there; such rows are idle slots whose output is
never read).

``decode_attention`` is a torch custom op (one dispatched op); on CUDA after
:func:`self_check` passed and the static engine's start-up timing found it faster than SDPA
at the engine's own shapes (:func:`time_against_sdpa`), or under ``TRITON_INTERPRET=1``, the kernel
runs; otherwise the SDPA reference. tests/unit/models/test_decode_kernels.py runs it under the interpreter.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from workers.models.blocks.decode_kernels import agrees, device_key, triton, usable

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, m_ptr, o_ptr, window, scale,
                                 q_row, q_head, k_row, k_pos, k_head, v_row, v_pos, v_head, m_row, o_row, o_head,
                                 G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                                 IEEE: tl.constexpr):
        row, kh = tl.program_id(0), tl.program_id(1)
        offs_g, offs_d = tl.arange(0, GP), tl.arange(0, D)
        g_ok = offs_g < G
        q = tl.load(q_ptr + row * q_row + kh * q_head + offs_g[:, None] * D + offs_d[None, :], mask=g_ok[:, None],
                    other=0.0)
        m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GP], dtype=tl.float32)
        acc = tl.zeros([GP, D], dtype=tl.float32)
        for start in range(0, window, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < window
            k = tl.load(k_ptr + row * k_row + offs_n[:, None] * k_pos + kh * k_head + offs_d[None, :],
                        mask=n_ok[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            bias = tl.load(m_ptr + row * m_row + offs_n, mask=n_ok, other=float("-inf")).to(tl.float32)
            s = s * scale + bias[None, :]
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no NaN from -inf - -inf
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + row * v_row + offs_n[:, None] * v_pos + kh * v_head + offs_d[None, :],
                        mask=n_ok[:, None], other=0.0)
            if IEEE:
                pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(o_ptr + row * o_row + kh * o_head + offs_g[:, None] * D + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=g_ok[:, None])


CHECKED: dict[str, bool] = {}
"""Per CUDA device: did :func:`self_check` find this kernel equal to SDPA there."""


SLOWER: set[tuple[str, int, int, int]] = set()
"""(device, kv heads, g, D) where :func:`time_against_sdpa` found the kernel slower than SDPA: SDPA runs there."""


def _checked(q: torch.Tensor) -> bool:
    if not usable(q):
        return False
    checked = not q.is_cuda or CHECKED.get(str(q.device), False)
    return checked and (str(q.device), *q.shape[1:]) not in SLOWER


def time_against_sdpa(device: torch.device, dtype: torch.dtype, *, rows: int, kv_heads: int, group: int,
                      head_dim: int, windows: list[int], iters: int = 10) -> tuple[float, float]:
    """Microseconds per call of the kernel and of SDPA at an engine's shapes (summed over ``windows``),
    timed on ``device`` at start-up, before any graph capture; where the kernel is slower its shape goes
    to :data:`SLOWER` and SDPA keeps the decode (a correct kernel is not enough: it must also pay)."""
    total = {"kernel": 0.0, "sdpa": 0.0}
    for w in windows:  # drawn on the device: no host draw of ~100 MB at every start
        q = torch.randn(rows, kv_heads, group, head_dim, device=device, dtype=dtype)
        keys, values = (torch.randn(rows, w, kv_heads, head_dim, device=device, dtype=dtype) for _ in range(2))
        mask = torch.zeros(rows, w, device=device, dtype=dtype)
        for name, fn in (("kernel", decode_attention_triton), ("sdpa", decode_attention_reference)):
            for _ in range(3):
                fn(q, keys, values, mask, head_dim ** -0.5)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn(q, keys, values, mask, head_dim ** -0.5)
            end.record()
            end.synchronize()
            total[name] += start.elapsed_time(end) * 1e3 / iters
        del q, keys, values, mask
    if total["kernel"] > total["sdpa"]:
        SLOWER.add((device_key(device), kv_heads, group, head_dim))
    return total["kernel"], total["sdpa"]


ENABLED = True
"""False: SDPA even where the kernel checked out (benchmarks/gpu/bench_decode_step.py's side-by-side row)."""
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's CPU interpreter multiplies bf16 blocks wrongly (tl.dot on the raw bits): there the dots
take the same bf16-rounded operands in float32, which is what the tensor cores accumulate in."""


def decode_attention_triton(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                            scale: float) -> torch.Tensor:
    b, hkv, g, d = q.shape
    window = keys.shape[1]
    q = q if q.stride(-1) == 1 and q.stride(-2) == d else q.contiguous()
    assert keys.stride(-1) == 1 and values.stride(-1) == 1 and mask.stride(-1) == 1, "dense last dims"
    out = torch.empty(b, hkv, g, d, dtype=q.dtype, device=q.device)
    block_n = 64 if d <= 64 else 32
    _decode_attention_kernel[(b, hkv)](
        q, keys, values, mask, out, window, float(scale),
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), mask.stride(0), out.stride(0), out.stride(1),
        G=g, GP=max(16, triton.next_power_of_2(g)), D=d, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32 or INTERPRETED, num_warps=4)
    return out


def decode_attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """SDPA over the grouped rows: q ``[B, kv_heads, g, D]``, keys / values ``[B, window, kv_heads, D]``,
    mask ``[B, window]`` additive."""
    return F.scaled_dot_product_attention(q, keys.transpose(1, 2), values.transpose(1, 2),
                                          attn_mask=mask[:, None, None, :].to(q.dtype), scale=scale)


@torch.library.custom_op("slurmrl::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for one query token per row, grouped query heads: q ``[B, kv_heads,
    g, D]`` (query head ``j*g+i`` at ``[:, j, i]``), keys / values ``[B, window, kv_heads, D]`` (cache
    slot views), mask ``[B, window]`` additive; returns ``[B, kv_heads, g, D]``."""
    if ENABLED and _checked(q) and q.shape[-1] in (64, 128, 256) and q.shape[2] <= 128:
        return decode_attention_triton(q, keys, values, mask, scale)
    return decode_attention_reference(q, keys, values, mask, scale)


@decode_attention.register_fake
def _(q, keys, values, mask, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def self_check(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> tuple[bool, str]:
    """Run the kernel once on ``device`` against SDPA (outside any capture) and remember the verdict
    (:data:`CHECKED`); a failure to compile or a disagreement leaves SDPA on. Returns (passed, why)."""
    device = torch.device(device)
    if device.type != "cuda" or triton is None:
        return False, "not a CUDA device" if triton is not None else "no triton"
    key = device_key(device)
    if key not in CHECKED:
        try:
            CHECKED[key] = check(device, dtype, agrees)
            why = "agrees with SDPA" if CHECKED[key] else "disagrees with SDPA on this GPU: SDPA runs instead"
        except Exception as e:  # noqa: BLE001 - any compile or launch failure: SDPA
            CHECKED[key] = False
            why = f"does not run here ({type(e).__name__}: {str(e).splitlines()[0][:200]}): SDPA runs instead"
        _WHY[key] = why
    return CHECKED[key], f"the decode-attention kernel {_WHY[key]}"


_WHY: dict[str, str] = {}


def check(device: torch.device, dtype: torch.dtype, close) -> bool:
    """:func:`self_check`'s comparison: the kernel against SDPA on ``device`` (strided cache views, a
    sliding window's masked prefix, GQA 8:1 with D 128 and 3:1 with D 64)."""
    g = torch.Generator(device="cpu").manual_seed(1)
    ok = True
    for hkv, grp, d, w in ((4, 8, 128, 80), (3, 3, 64, 130)):
        cache = torch.randn(5, 160, hkv, d, generator=g).to(device=device, dtype=dtype)
        vals = torch.randn(5, 160, hkv, d, generator=g).to(device=device, dtype=dtype)
        keys, values = cache[:3, :w], vals[:3, :w]  # slot views: row stride 160 * hkv * d
        q = torch.randn(3, hkv, grp, d, generator=g).to(device=device, dtype=dtype)
        seen = torch.ones(3, w, dtype=torch.bool, device=device)
        seen[0, 40:] = False  # causal end
        seen[1, :70] = False  # a window that skips the first blocks
        mask = torch.zeros(3, w, dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))
        got = decode_attention_triton(q, keys, values, mask, d ** -0.5)
        ok = ok and close(got, decode_attention_reference(q, keys, values, mask, d ** -0.5))
    return bool(ok)
