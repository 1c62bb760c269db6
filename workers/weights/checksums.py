"""Checksums of tensors and flat buffers, cheap enough to run on every weight update.

Why xxh3-64: measured here at ~16 GB/s on one core (xxh64: 8.5, xxh3-128: 11.8), and
python-xxhash releases the GIL while it hashes. Where bytes stream through this process
(shard files, packed send buckets) they are hashed chunk by chunk while still in cache
(shards.py); where they land by themselves (a received bucket) or must be known before
writing (delta mode), :class:`Hasher` hashes in a small thread pool while the next bucket
or tensor moves. Digests are 16 hex characters, stored per tensor in a step's index.json;
streaming and one-shot xxh3 give the same digest.

CUDA buffers (the NCCL path of the broadcast) are not copied to the host to be hashed:
:func:`buffer_checksum` computes a position-weighted 64-bit sum with torch ops on the
device instead. Sender and receiver of one bucket are always on the same kind of device
(gloo: CPU, NCCL: GPU), so both sides compute the same function.
"""
from __future__ import annotations

import concurrent.futures as cf
from typing import Iterable, Mapping, Optional

import numpy as np
import torch
import xxhash

from workers.weights.digest import state_digest  # noqa: F401  (torch-free home, re-exported)

HASH_NAME = "xxh3"
"""Key of the per-tensor digest in index.json."""
_WEIGHT_COLS = 4096


def byte_view(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a contiguous CPU tensor as a uint8 numpy array (no copy)."""
    assert t.device.type == "cpu" and t.is_contiguous(), (t.device, t.is_contiguous())
    return t.reshape(-1).view(torch.uint8).numpy()


def xxh3_hex(buf) -> str:
    """xxh3-64 of a buffer (bytes, memoryview, numpy array) as 16 hex digits."""
    return f"{xxhash.xxh3_64_intdigest(buf):016x}"


def tensor_hash(t: torch.Tensor) -> str:
    """xxh3-64 of a tensor's raw bytes: equal digests mean bit-identical tensors."""
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.contiguous().cpu()
    return xxh3_hex(byte_view(t))


def state_hashes(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Digest of every tensor of a state dict (tests compare trainer and inference with it)."""
    return {name: tensor_hash(t) for name, t in state.items()}


_SCREENED = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""dtypes ``torch._foreach_norm`` takes (float8 and complex tensors are checked one by one)."""


def nonfinite_names(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the floating tensors holding NaN or inf, checked where they live (one host sync when
    every tensor is finite, which is every publish of a healthy run).

    For paths whose bytes never stream through this process before they leave it (the
    broadcast sender, the received buckets). First a screen: ``torch._foreach_norm(ord=1)`` per
    (device, dtype) group, a few multi-tensor kernels for the whole model instead of two kernels a
    tensor (what training waits for at every publish). A finite sum of magnitudes proves every
    element finite (NaN and inf propagate through a sum in any order); a non-finite one may also be a
    finite tensor whose sum overflowed, so then every tensor is checked on its own, as before.
    """
    named = []
    for name, t in tensors:
        if t.dtype.is_floating_point or t.dtype.is_complex:
            named.append((name, t.detach().float() if t.dtype == torch.float8_e4m3fn else t.detach()))
    if not named:
        return []
    groups: dict[tuple, list[torch.Tensor]] = {}
    for _, t in named:
        groups.setdefault((t.device, t.dtype), []).append(t)
    if len(groups) == 1 and next(iter(groups))[1] in _SCREENED:
        (group,) = groups.values()
        if bool(torch.isfinite(torch.stack(torch._foreach_norm(group, 1))).all()):
            return []
    ok = torch.stack([torch.isfinite(t).all() for _, t in named]).tolist()
    return sorted(n for (n, _), good in zip(named, ok) if not good)


def _device_checksum(flat_u8: torch.Tensor) -> str:
    """Position-weighted wrapping int64 sum of a device buffer's 8-byte words, plus its tail.

    Not cryptographic, but any single flipped bit, swapped pair of words, truncation or
    zeroed region changes it (every word position has its own odd multiplier).
    """
    n = flat_u8.numel()
    gen = torch.Generator().manual_seed(0x5EED)
    weights = (torch.randint(0, 2**62, (_WEIGHT_COLS,), generator=gen, dtype=torch.int64) * 2 + 1).to(flat_u8.device)
    whole = n // (8 * _WEIGHT_COLS) * 8 * _WEIGHT_COLS
    acc = torch.zeros((), dtype=torch.int64, device=flat_u8.device)
    if whole:
        words = flat_u8[:whole].view(torch.int64).view(-1, _WEIGHT_COLS)
        rows = torch.arange(words.shape[0], device=flat_u8.device, dtype=torch.int64) * 2654435761 * 2 + 1
        acc += ((words * weights).sum(1) * rows).sum()  # int64 products wrap: a sum mod 2**64
    tail = flat_u8[whole:].to(torch.int64)
    if tail.numel():
        acc += (tail * weights.repeat(tail.numel() // _WEIGHT_COLS + 1)[:tail.numel()]).sum()
    return f"{(int(acc) ^ n) & (2**64 - 1):016x}"


def buffer_checksum(buf: torch.Tensor) -> str:
    """Checksum of a contiguous buffer of any dtype: xxh3-64 on CPU, a torch-op hash on CUDA."""
    flat = buf.reshape(-1).view(torch.uint8)
    if flat.device.type == "cpu":
        return xxh3_hex(flat.numpy())
    return _device_checksum(flat)


def digest_int64(hexdigest: str) -> tuple[int, int]:
    """A 64-bit hex digest as two non-negative 32-bit halves (fits an int64 header tensor)."""
    v = int(hexdigest, 16)
    return v >> 32, v & 0xFFFFFFFF


def digest_from_int64(hi: int, lo: int) -> str:
    return f"{(int(hi) << 32) | int(lo):016x}"


class Hasher:
    """A small thread pool that hashes tensors while the caller does I/O.

    ``submit(t)`` returns a future of :func:`tensor_hash`; ``num_threads=0`` hashes inline
    (a future that is already done), which the benchmark uses to show what overlap buys.
    """

    def __init__(self, num_threads: int = 2):
        self.num_threads = num_threads
        self._pool: Optional[cf.ThreadPoolExecutor] = (
            cf.ThreadPoolExecutor(num_threads, thread_name_prefix="weights-hash") if num_threads > 0 else None)

    def submit(self, fn, *args) -> cf.Future:
        if self._pool is None:
            fut: cf.Future = cf.Future()
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # surfaced by result(), as a pool would
                fut.set_exception(e)
            return fut
        return self._pool.submit(fn, *args)

    def hash_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, cf.Future]:
        return {name: self.submit(tensor_hash, t) for name, t in tensors}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
