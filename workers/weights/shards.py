"""safetensors files written and read without extra copies, hashed while the bytes move.

Why not ``safetensors.torch.save_file`` / ``load_file``: save_file serialises the whole
shard into one bytes object before writing (a second copy of the model in memory and a
memcpy on the critical path), and load_file reads whole files. Here a shard is written
straight from the tensors' memory and read tensor by tensor into a caller-owned staging
buffer (a delta step reads only the tensors it needs). The files are ordinary safetensors
(8-byte little-endian header length, JSON header padded with spaces to 8 bytes, data with
no holes): ``safetensors.torch.load_file`` reads them (tests check that).

Hashing rides along: each 4 MiB chunk is fed to a streaming xxh3 right after it was
written or read, while it is still in the CPU cache, so checksums cost no extra pass over
memory. Measured here (115 MB, /dev/shm, 2 busy cores): reading 17 ms raw, 19.5 ms with
inline hashing, 32 ms with a hash future per tensor on a 2-thread pool (which re-reads
every tensor from DRAM and competes for the cores). Parallelism comes from shards: every
trainer rank writes its own, and the reader reads files in parallel threads.

Finiteness rides along the same way: :class:`FiniteScan` checks each chunk of a floating
tensor for NaN/inf right after it was hashed, so a non-finite tensor is named (publisher:
refused before the step exists; reader: the load is refused) at no extra pass over memory.

Tensors are laid out by element size, largest first, so every data offset is a multiple of
its own element size without padding. Errors raise :class:`ShardError` naming the file and
the reason (missing, unreadable header, truncated, tensor absent or mis-described).
"""
from __future__ import annotations

import json
import math
import os
import stat
import struct
from pathlib import Path
from typing import Mapping, Optional, Sequence

import torch

import xxhash

from workers.common.dtypes import TABLE as DTYPE_TABLE
from workers.weights.checksums import byte_view

ST_DTYPES = {getattr(torch, name): code for name, (code, _size) in DTYPE_TABLE.items()}
"""torch dtype -> safetensors code, from the one dtype table (workers/common/dtypes.py)."""
FROM_ST = {v: k for k, v in ST_DTYPES.items()}
NAMES = {t: str(t).replace("torch.", "") for t in ST_DTYPES}
"""torch dtype -> the name index.json and SGLang's HTTP API use (``bfloat16``)."""
BY_NAME = {v: k for k, v in NAMES.items()}
CHUNK = 4 << 20
"""Bytes per write/read syscall and per hash update: small enough to stay in cache for the hash,
large enough for the disk (one 1 GiB write took 9.2 s on this machine's disk, 64 MiB chunks 1.4 s)."""
ALIGN = 64


class ShardError(RuntimeError):
    """A shard file is missing, truncated or does not describe the tensors it should hold."""


def dtype_from_name(name: str) -> torch.dtype:
    if name not in BY_NAME:
        raise ValueError(f"dtype {name!r} is not one of {sorted(BY_NAME)}")
    return BY_NAME[name]


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def meta_nbytes(dtype_name: str, shape) -> int:
    """Bytes of a tensor described by (dtype name, shape), as index.json and SGLang describe it."""
    n = 1
    for d in shape:
        n *= int(d)
    return n * dtype_from_name(dtype_name).itemsize


def layout(tensors: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Largest element size first (stable), so offsets stay aligned with no holes."""
    return sorted(tensors, key=lambda nt: -nt[1].element_size())


class FiniteScan:
    """Is a floating tensor free of NaN/inf? Fed the bytes done so far, chunk by chunk.

    Why chunked: the check runs on bytes still in cache from the hash (the same pass).
    Integer and bool tensors are always finite; float8 chunks (no CPU sum/isfinite kernels
    for every variant) are checked through a float32 copy.
    """

    def __init__(self, flat_u8: torch.Tensor, dtype: torch.dtype):
        self.flat, self.dtype, self.size = flat_u8, dtype, dtype.itemsize
        self.active = dtype.is_floating_point or dtype.is_complex
        self.done, self.ok = 0, True

    def upto(self, nbytes: int) -> None:
        """Check elements wholly inside the first ``nbytes`` bytes (not checked before)."""
        end = nbytes // self.size * self.size
        if not (self.active and self.ok) or end <= self.done:
            return
        part = self.flat[self.done: end].view(self.dtype)
        if self.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            part = part.float()
        # A NaN or inf always makes the sum NaN or inf; a finite sum proves the chunk finite.
        # The sum streams at memory speed (measured ~7 GB/s per core for float32, isfinite().all()
        # ~1 GB/s); a non-finite sum (NaN/inf, or finite values that overflow) gets the exact check.
        self.ok = math.isfinite(float(part.sum())) or bool(torch.isfinite(part).all())
        self.done = end


def write_shard(path: Path, tensors: Sequence[tuple[str, torch.Tensor]],
                metadata: Optional[Mapping[str, str]] = None, nonfinite: Optional[list] = None) -> dict[str, str]:
    """Write ``tensors`` (contiguous, CPU) to ``path`` via ``path.partial`` + fsync + rename.

    Returns {name: xxh3 digest} (checksums.tensor_hash), computed chunk by chunk as written;
    names of tensors holding NaN/inf are appended to ``nonfinite`` (checked in the same pass).
    """
    writer = ShardWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors], metadata)
    try:
        for name, t in layout(tensors):
            writer.write(name, t)
    except BaseException:
        writer.abort()
        raise
    return writer.finish(nonfinite)


class ShardWriter:
    """One safetensors shard written as its tensors arrive, in any order (``os.pwrite`` at offsets
    fixed by the header), so a publisher streaming a sharded model never holds the shard in memory.

    The header is computed from (name, dtype, shape) alone, in :func:`layout` order: the file is
    byte for byte what :func:`write_shard` writes for the same tensors. Each tensor is hashed and
    scanned for NaN/inf chunk by chunk as its bytes are written (one pass over memory)."""

    def __init__(self, path: Path, entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: Optional[Mapping[str, str]] = None):
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset, self.offsets = 0, {}
        for name, dtype, shape in sorted(entries, key=lambda e: -e[1].itemsize):  # layout(): largest element first
            size = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            self.offsets[name] = (offset, size, dtype, tuple(shape))
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path, self.tmp = path, path.with_name(path.name + ".partial")
        self.data_start = 8 + len(raw)
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.digests: dict[str, str] = {}
        self.bad: list[str] = []
        _write_all(self.fd, memoryview(struct.pack("<Q", len(raw)) + raw), None)

    def write(self, name: str, t: torch.Tensor) -> str:
        """Write tensor ``name`` (contiguous, CPU) at its place; returns its digest."""
        offset, size, dtype, shape = self.offsets[name]
        assert t.device.type == "cpu" and t.is_contiguous() and t.dtype == dtype and tuple(t.shape) == shape, \
            (name, t.device, t.dtype, tuple(t.shape), dtype, shape)
        assert name not in self.digests, f"{name} written twice"
        h, scan = xxhash.xxh3_64(), FiniteScan(t.reshape(-1).view(torch.uint8), t.dtype)
        _write_all(self.fd, memoryview(byte_view(t)), h, scan, at=self.data_start + offset)
        self.digests[name] = f"{h.intdigest():016x}"
        if not scan.ok:
            self.bad.append(name)
        return self.digests[name]

    def finish(self, nonfinite: Optional[list] = None) -> dict[str, str]:
        """fsync, rename into place; returns {name: digest}. Every tensor must have been written."""
        missing = sorted(set(self.offsets) - set(self.digests))
        if missing:
            self.abort()
            raise ShardError(f"shard {self.path}: {len(missing)} tensors never written, e.g. {missing[:3]}")
        try:
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
        os.rename(self.tmp, self.path)
        if nonfinite is not None:
            nonfinite.extend(n for n in self.offsets if n in self.bad)  # layout order, as write_shard reports
        return self.digests

    def abort(self) -> None:
        """Close and delete the partial file (a failed publish leaves nothing half-written)."""
        try:
            os.close(self.fd)
        except OSError:
            pass
        self.tmp.unlink(missing_ok=True)


def _write_all(fd: int, view: memoryview, h, scan: Optional[FiniteScan] = None, at: Optional[int] = None) -> None:
    """Write all of ``view`` at the file position (``at`` None) or at byte ``at`` (pwrite)."""
    done = 0
    while len(view):
        n = os.write(fd, view[:CHUNK]) if at is None else os.pwrite(fd, view[:CHUNK], at + done)
        if h is not None:
            h.update(view[:n])  # just written: still in cache
        done += n
        if scan is not None:
            scan.upto(done)
        view = view[n:]


def open_regular(path: Path, what: str):
    """Open ``path`` for reading only if it is a regular file (not a symlink, FIFO or device).

    Why before reading: a FIFO blocks ``open`` until a writer appears and a device never
    ends, either of which would hold the worker's weight lock forever. O_NONBLOCK makes
    the open itself return at once; O_NOFOLLOW refuses a symlink (one could point outside
    the weights root); fstat on the opened fd leaves no window for a swap.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ShardError(f"{what} {path} does not exist (deleted by retention, or never written)") from None
    except OSError as e:  # ELOOP: a symlink; ENXIO/EACCES/...: not a readable file
        kind = "a symlink" if os.path.islink(path) else f"unreadable ({e.strerror})"
        raise ShardError(f"{what} {path} is {kind}: only regular files are read") from None
    except ValueError as e:  # a NUL byte in the path
        raise ShardError(f"{what} {path!r} is not a valid path ({e})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ShardError(f"{what} {path} is not a regular file (mode {stat.filemode(st.st_mode)}): refused")
    return os.fdopen(fd, "rb", buffering=0)


def _read_exact(f, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = f.read(min(n - len(out), CHUNK))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def read_header(path: Path, f=None) -> tuple[dict, int]:
    """(header without __metadata__, byte offset where the data starts); checks the size and
    that every entry is {dtype, shape, data_offsets} with sane offsets (ShardError otherwise)."""
    own = f is None
    f = open_regular(path, "shard") if own else f
    try:
        size = os.fstat(f.fileno()).st_size
        f.seek(0)
        head = _read_exact(f, 8)
        if len(head) < 8:
            raise ShardError(f"shard {path} is truncated: {size} bytes, not even a header length")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise ShardError(f"shard {path} is truncated: {size} bytes, its header alone needs {8 + n}")
        header = json.loads(_read_exact(f, n))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ShardError(f"shard {path} has an unreadable header ({type(e).__name__}: {str(e)[:200]})") from None
    finally:
        if own:
            f.close()
    if not isinstance(header, dict):
        raise ShardError(f"shard {path}: header is not a JSON object")
    header.pop("__metadata__", None)
    for name, h in header.items():
        offs = h.get("data_offsets") if isinstance(h, dict) else None
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)
                and 0 <= offs[0] <= offs[1] and isinstance(h.get("shape"), list)):
            raise ShardError(f"shard {path}: header entry {name!r} is malformed (need dtype, shape, "
                             f"data_offsets [begin, end]): {str(h)[:200]}")
    end = max((h["data_offsets"][1] for h in header.values()), default=0)
    if 8 + n + end > size:
        raise ShardError(f"shard {path} is truncated: {size} bytes, its header describes {8 + n + end}")
    if 8 + n + end < size:
        raise ShardError(f"shard {path} has {size - 8 - n - end} bytes after its last tensor (corrupt or overwritten)")
    return header, 8 + n


class Staging:
    """A reusable host (or device) byte buffer that received tensors live in until applied.

    Reused across updates so a load does not page-fault a fresh model-sized allocation
    every time; tensors handed out are views, valid until the next ``reserve``.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.buf = torch.empty(0, dtype=torch.uint8, device=self.device)

    def reserve(self, total: int) -> torch.Tensor:
        if self.buf.numel() < total:
            self.buf = torch.empty(total, dtype=torch.uint8, device=self.device)
        return self.buf


def read_tensors(path: Path, wanted: Mapping[str, tuple[str, list[int]]], staging: torch.Tensor,
                 base: int) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    """Read ``wanted`` {name: (dtype name, shape)} from one shard into ``staging[base:]``.

    Returns ({name: tensor view}, {name: xxh3 digest of the bytes read}, [names holding
    NaN/inf]), hashed and scanned chunk by chunk as read. Raises ShardError if the file is
    not a regular file, a wanted tensor is absent or the header disagrees with the expected
    dtype or shape.
    """
    out, digests, nonfinite = {}, {}, []
    offset = base
    with open_regular(path, "shard") as f:
        header, data_start = read_header(path, f)
        for name, (dtype_name, shape) in sorted(wanted.items(), key=lambda kv: header.get(kv[0], {}).get(
                "data_offsets", [0])[0]):
            h = header.get(name)
            if h is None:
                raise ShardError(f"shard {path} does not hold tensor {name} that index.json places there")
            dtype = dtype_from_name(dtype_name)
            if h.get("dtype") != ST_DTYPES[dtype] or list(h["shape"]) != list(shape):
                raise ShardError(f"tensor {name}: shard {path} says {h.get('dtype')}{h['shape']}, "
                                 f"index.json says {ST_DTYPES[dtype]}{list(shape)}")
            begin, end = h["data_offsets"]
            if end - begin != meta_nbytes(dtype_name, shape):
                raise ShardError(f"tensor {name}: shard {path} gives it {end - begin} bytes, "
                                 f"{dtype_name}{list(shape)} needs {meta_nbytes(dtype_name, shape)}")
            region = staging[offset: offset + end - begin]
            f.seek(data_start + begin)
            view, h, scan = memoryview(region.numpy()), xxhash.xxh3_64(), FiniteScan(region, dtype)
            done = 0
            while len(view):
                n = f.readinto(view[:CHUNK])
                if not n:
                    raise ShardError(f"shard {path} ended early while reading {name}")
                h.update(view[:n])  # just read: still in cache
                done += n
                scan.upto(done)
                view = view[n:]
            out[name] = region.view(dtype).view(shape) if end > begin else torch.empty(shape, dtype=dtype)
            digests[name] = f"{h.intdigest():016x}"
            if not scan.ok:
                nonfinite.append(name)
            offset += -(-(end - begin) // ALIGN) * ALIGN
    return out, digests, nonfinite


def aligned_size(sizes) -> int:
    """Bytes of staging that ``read_tensors`` needs for tensors of these byte sizes."""
    return sum(-(-s // ALIGN) * ALIGN for s in sizes)
