"""Fused elementwise kernels of the static engine's decode step, one launch each (issue 45).

Why: a small model's decode step is hundreds of tiny kernels replayed as one CUDA graph, and each
costs its launch slot (~3 us) whatever it computes, so the step's floor is its kernel count. The
torch ops of a dense layer's decode (SmolLM2: 38 a layer) are mostly elementwise chains: RMSNorm
is 8 (upcast, square, mean, add, rsqrt, multiply, downcast, weight), the rotary embedding 5, the
two KV-cache writes 2, SwiGLU's activation 2. Here each chain is one op:

* :func:`rms_norm` -- ``weight * rms_normalize(x)`` (workers/models/blocks/norm.py's RMSNorm);
* :func:`add_rms_norm` -- the residual add and the next norm: ``(x + d, rms_norm(x + d))``;
* :func:`rope_write_kv` -- the rotary embedding of q and k of one token per row (NeoX halves,
  ``sin_signed`` from attention.signed_sin), k and v written to each row's cache slot at its
  position; returns the rotated q ``[B, heads, D]``;
* :func:`silu_mul` -- ``silu(gate) * up``;
* workers/models/blocks/decode_attention.py -- GQA of one token per row over the cache slots
  (its own start-up check and verdict: a failing attention kernel leaves these on).

Each is a torch custom op (``slurmrl::*``): one dispatched op, so the decode-step counter
(benchmarks/gpu/bench_decode_step.py) counts it as the one kernel it is on a GPU. On CUDA (or under
``TRITON_INTERPRET=1``) a Triton kernel runs; elsewhere the torch reference, which is the
unfused code's exact op sequence (CPU results do not change). The Triton kernels round where the
torch ops round (each bf16 product / sum), so they differ only by the order of the norm's sum.
tests/unit/models/test_decode_kernels.py runs them under Triton's interpreter against the references.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from workers.models.blocks.norm import rms_normalize

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs without triton
    triton = None


_CHECKED: dict[str, tuple[bool, str]] = {}
"""Per CUDA device: did :func:`self_check` find the kernels equal to the references there (and why not)."""


def usable(x: torch.Tensor) -> bool:
    """The Triton kernels apply: Triton present and either the interpreter (CPU tests) or a CUDA device
    where :func:`self_check` passed (the engine runs it before capturing graphs; unchecked: the torch
    ops, which are always right)."""
    if triton is None:
        return False
    if x.is_cuda:
        return _CHECKED.get(str(x.device), (False, ""))[0]
    return os.environ.get("TRITON_INTERPRET") == "1"


def agrees(a: torch.Tensor, b: torch.Tensor) -> bool:
    """A kernel's output ``a`` equals the torch reference ``b`` up to bf16 rounding (relative to b's largest)."""
    return bool(((a.float() - b.float()).abs() <= 2e-2 * b.float().abs().max() + 1e-3).all())


def device_key(device: torch.device) -> str:
    """``cuda:N`` (the index made explicit), as tensors' ``str(t.device)`` reads."""
    device = torch.device(device)
    return str(device if device.index is not None else torch.device("cuda", torch.cuda.current_device()))


def self_check(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> tuple[bool, str]:
    """Run each kernel once on ``device`` against its torch reference (small random inputs, outside any
    graph capture) and remember the verdict for :func:`usable`: a kernel that fails to compile or
    disagrees on this GPU stack leaves the decode on the torch ops, with the reason logged, instead
    of failing a run. Returns (passed, why)."""
    device = torch.device(device)
    if device.type != "cuda" or triton is None:
        return False, "not a CUDA device" if triton is not None else "no triton"
    key = device_key(device)
    if key in _CHECKED:
        return _CHECKED[key]
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    close = agrees

    try:
        b, nh, nkv, d, hid = 3, 4, 2, 64, 192
        x, dx, w = rnd(b, hid), rnd(b, hid), rnd(hid)
        s, y = rms_norm_triton(x, w, 1e-6, dx)
        ok = close(rms_norm_triton(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))
        ok = ok and close(s, x + dx) and close(y, rms_norm_reference(x + dx, w, 1e-6))
        gate, up = rnd(b, 300), rnd(b, 300)
        ok = ok and close(silu_mul_triton(gate, up), F.silu(gate) * up)
        qkv = rnd(b, (nh + 2 * nkv) * d)  # slices of one output, as fp8's fused q/k/v GEMM gives them
        q, k, v = qkv.split([nh * d, nkv * d, nkv * d], dim=1)
        cos, sin = rnd(b, d), rnd(b, d)
        caches = [torch.zeros(4, 8, nkv, d, device=device, dtype=dtype) for _ in range(4)]
        slots = torch.tensor([2, 0, 3], device=device)
        pos = torch.tensor([5, 0, 7], device=device)
        got = rope_write_kv_triton(q, k, v, cos, sin, caches[0], caches[1], slots, pos)
        want = rope_write_kv_reference(q, k, v, cos, sin, caches[2], caches[3], slots, pos)
        ok = ok and close(got, want) and close(caches[0], caches[2]) and close(caches[1], caches[3])
        verdict = (bool(ok), "the decode kernels agree with the torch ops" if ok else
                   "a decode kernel disagrees with its torch reference on this GPU: the torch ops run instead")
    except Exception as e:  # noqa: BLE001 - any compile or launch failure means: use the torch ops
        verdict = (False, f"the decode kernels do not run here ({type(e).__name__}: {str(e).splitlines()[0][:200]}): "
                          f"the torch ops run instead")
    _CHECKED[key] = verdict
    return verdict


# ---- torch references (the unfused path's exact ops) ----------------------------------------
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * rms_normalize(x, eps)


def rope_write_kv_reference(q, k, v, cos, sin_signed, keys, values, slots, pos) -> torch.Tensor:
    b, d = q.shape[0], cos.shape[-1]
    nh, half = q.shape[1] // d, d // 2
    qk = torch.cat([q.view(b, nh, d), k.view(b, -1, d)], dim=1)
    out = qk * cos[:, None] + torch.cat([qk[..., half:], qk[..., :half]], dim=-1) * sin_signed[:, None]
    keys[slots, pos] = out[:, nh:]
    values[slots, pos] = v.view(b, -1, d)
    return out[:, :nh].contiguous()


# ---- Triton kernels ----------------------------------------------------------------------------
if triton is not None:
    @triton.jit
    def _norm_kernel(x_ptr, d_ptr, w_ptr, out_ptr, res_ptr, n, eps, HAS_ADD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + row * n + offs, mask=m, other=0.0)
        if HAS_ADD:  # the residual add, rounded to the stream's dtype as torch's add is
            x = (x.to(tl.float32) + tl.load(d_ptr + row * n + offs, mask=m, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(res_ptr + row * n + offs, x, mask=m)
        xf = x.to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
        normed = (xf * r).to(x.dtype).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=m, other=0.0)
        tl.store(out_ptr + row * n + offs, (w.to(tl.float32) * normed).to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _rope_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, keys_ptr, values_ptr, slots_ptr, pos_ptr, qo_ptr,
                        nh, nkv, max_len, q_row, k_row, v_row, D: tl.constexpr):
        row, head = tl.program_id(0), tl.program_id(1)
        offs = tl.arange(0, D)
        swap = (offs + D // 2) % D
        c = tl.load(cos_ptr + row * D + offs).to(tl.float32)
        s = tl.load(sin_ptr + row * D + offs).to(tl.float32)
        if head < nh:
            src, dst = q_ptr + row * q_row + head * D, qo_ptr + (row * nh + head) * D
        else:
            kh = head - nh
            src = k_ptr + row * k_row + kh * D
            at = (tl.load(slots_ptr + row) * max_len + tl.load(pos_ptr + row)) * nkv + kh
            dst = keys_ptr + at * D
            tl.store(values_ptr + at * D + offs, tl.load(v_ptr + row * v_row + kh * D + offs))
        x = tl.load(src + offs)
        xs = tl.load(src + swap)
        a = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)  # each product rounded, as torch's bf16 ops
        b = (xs.to(tl.float32) * s).to(x.dtype).to(tl.float32)
        tl.store(dst + offs, (a + b).to(x.dtype))

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        g = tl.load(g_ptr + offs, mask=m, other=0.0)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, (act * u).to(g.dtype), mask=m)


def rms_norm_triton(x, weight, eps, delta=None):
    n = x.shape[-1]
    x, weight = x.contiguous(), weight.contiguous()  # no copy on the decode path (GEMM and add outputs)
    delta = delta.contiguous() if delta is not None else None
    out = torch.empty_like(x)
    res = torch.empty_like(x) if delta is not None else out
    _norm_kernel[(x.numel() // n,)](x, delta if delta is not None else x, weight, out, res, n, float(eps),
                                    HAS_ADD=delta is not None, BLOCK=triton.next_power_of_2(n))
    return out if delta is None else (res, out)


def rope_write_kv_triton(q, k, v, cos, sin_signed, keys, values, slots, pos):
    """q / k / v may be row-strided views (fp8's one GEMM for q, k and v hands out column slices of
    its output): each row is read at its own stride, the columns must be dense."""
    b, d = q.shape[0], cos.shape[-1]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    nh, nkv = q.shape[1] // d, k.shape[1] // d
    qo = torch.empty(b, nh, d, dtype=q.dtype, device=q.device)
    _rope_kv_kernel[(b, nh + nkv)](q, k, v, cos, sin_signed, keys, values, slots, pos, qo, nh, nkv,
                                   keys.shape[1], q.stride(0), k.stride(0), v.stride(0), D=d)
    return qo


def silu_mul_triton(gate, up):
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n, block = gate.numel(), 1024
    _silu_mul_kernel[(triton.cdiv(n, block),)](gate, up, out, n, BLOCK=block)
    return out


# ---- the custom ops (one dispatched op each) -----------------------------------------------------
@torch.library.custom_op("slurmrl::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rms_normalize(x, eps)`` over the last dim (``x`` contiguous)."""
    return rms_norm_triton(x, weight, eps) if usable(x) else rms_norm_reference(x, weight, eps)


@torch.library.custom_op("slurmrl::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, rms_norm(x + delta))``: a residual add and the next pre-norm in one pass."""
    if usable(x):
        return rms_norm_triton(x, weight, eps, delta)
    s = x + delta
    return s, rms_norm_reference(s, weight, eps)


@torch.library.custom_op("slurmrl::rope_write_kv", mutates_args=("keys", "values"))
def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                  keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """One token per row: q ``[B, heads*D]``, k / v ``[B, kv_heads*D]``, cos / sin_signed ``[B, D]``;
    the rotated k and v go to ``keys`` / ``values`` ``[S, L, kv_heads, D]`` at ``[slots, pos]`` (both
    ``[B]``); returns the rotated q ``[B, heads, D]``."""
    if usable(q):
        return rope_write_kv_triton(q, k, v, cos, sin_signed, keys, values, slots, pos)
    return rope_write_kv_reference(q, k, v, cos, sin_signed, keys, values, slots, pos)


@torch.library.custom_op("slurmrl::silu_mul", mutates_args=())
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (both contiguous, one shape)."""
    return silu_mul_triton(gate, up) if usable(gate) else F.silu(gate) * up


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@add_rms_norm.register_fake
def _(x, delta, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@rope_write_kv.register_fake
def _(q, k, v, cos, sin_signed, keys, values, slots, pos):
    return q.new_empty(q.shape[0], q.shape[1] // cos.shape[-1], cos.shape[-1])


@silu_mul.register_fake
def _(gate, up):
    return torch.empty_like(gate)
