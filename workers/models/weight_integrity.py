"""Are a checkpoint's safetensors files whole, and are their float values finite? Torch- and numpy-free.

Why here and not at load time: a teacher (``algorithm.teacher.path``) is read by the orchestrator's
scoring engine long after the launcher returned; a truncated shard then fails mid-run, and NaN
weights give NaN teacher log-probs, NaN advantages and a loss the trainer blames on the optimizer.
Both are decidable on the login node:

* **Truncation** needs only the headers: a safetensors file is ``u64 n | n bytes of JSON header |
  data``, every tensor's ``data_offsets`` are relative to the data, so the file must hold at least
  ``8 + n + max(end)`` bytes (:func:`check_complete`).
* **Non-finite values** need the data. Their bit patterns are fixed per dtype (an all-ones exponent),
  so the scan slices the byte that holds the exponent out of every element (``bytes[i::size]``),
  maps it through a 256-entry table to 0/1 (``bytes.translate``) and ANDs two such masks as big
  integers: C speed without numpy, about a second per few hundred MiB. A checkpoint up to
  :data:`FULL_SCAN_BYTES` is scanned whole; a larger one is sampled: :data:`SAMPLE_BYTES` at the start,
  middle and end of every tensor. A broken conversion (an overflowing cast, a NaN'd layer, a
  zero-filled-then-divided norm) poisons whole tensors, which sampling every tensor catches; a
  lone NaN element in a multi-GiB checkpoint would need a full read the login node should not pay for.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Iterator, Optional

from workers.models.hf_dir import CheckpointError, read_st_header, weight_map

FULL_SCAN_BYTES = 512 << 20
"""Checkpoints up to this many weight bytes are scanned element by element."""
SAMPLE_BYTES = 64 << 10
"""Bytes read at the start, middle and end of each tensor of a larger checkpoint."""


def _table(match) -> bytes:
    return bytes(1 if match(b) else 0 for b in range(256))


_ANY = _table(lambda b: True)
# dtype -> (element size, [(byte index within the element, table of the bits that must all be set)]):
# the value is non-finite when every listed byte matches (exponent all ones; for e4m3fn, S.1111.111).
_NONFINITE = {
    "F64": (8, [(7, _table(lambda b: b & 0x7F == 0x7F)), (6, _table(lambda b: b & 0xF0 == 0xF0))]),
    "F32": (4, [(3, _table(lambda b: b & 0x7F == 0x7F)), (2, _table(lambda b: b & 0x80))]),
    "BF16": (2, [(1, _table(lambda b: b & 0x7F == 0x7F)), (0, _table(lambda b: b & 0x80))]),
    "F16": (2, [(1, _table(lambda b: b & 0x7C == 0x7C))]),
    "F8_E5M2": (1, [(0, _table(lambda b: b & 0x7C == 0x7C))]),
    "F8_E4M3": (1, [(0, _table(lambda b: b & 0x7F == 0x7F))]),
}


def _header_length(path: Path) -> int:
    with open(path, "rb") as f:
        return struct.unpack("<Q", f.read(8))[0]


def check_complete(path: Path) -> dict:
    """The header of ``path``; CheckpointError when the file is shorter than its header says."""
    header = read_st_header(path)
    data_start = 8 + _header_length(path)
    end = 0
    for name, t in header.items():
        offsets = t.get("data_offsets") if isinstance(t, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(x, int) for x in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise CheckpointError(f"{path}: tensor {name!r} has no valid data_offsets in the header (corrupt file?)")
        end = max(end, offsets[1])
    size = os.path.getsize(path)
    if size < data_start + end:
        raise CheckpointError(f"{path}: truncated ({size} bytes, its header describes {data_start + end}): "
                              f"copy the file again")
    return header


def nonfinite_count(data: bytes, dtype: str) -> int:
    """Elements of ``data`` (little-endian ``dtype``) that are NaN or infinite; 0 for integer dtypes."""
    if dtype not in _NONFINITE:
        return 0
    size, parts = _NONFINITE[dtype]
    data = data[:len(data) - len(data) % size]
    mask = int.from_bytes(data[0::size].translate(_ANY), "little")
    for index, table in parts:
        mask &= int.from_bytes(data[index::size].translate(table), "little")
    return mask.bit_count()


def _windows(start: int, length: int, size: int, full: bool) -> Iterator[tuple[int, int]]:
    """(offset, bytes) to read of a tensor at ``start`` of ``length`` bytes: all of it, or three samples."""
    if full or length <= 3 * SAMPLE_BYTES:
        yield start, length
        return
    middle = (length // 2) // size * size
    for offset in (0, middle, length - SAMPLE_BYTES // size * size):
        yield start + offset, SAMPLE_BYTES // size * size


def first_nonfinite(directory: Path | str) -> Optional[tuple[str, str, bool]]:
    """(file, tensor, whether the scan was whole) of the first tensor holding a NaN/Inf, else None.
    Raises CheckpointError for a truncated or unreadable file."""
    directory = Path(directory)
    files = sorted(set(weight_map(directory).values()))
    headers = {f: check_complete(directory / f) for f in files}
    total = sum(os.path.getsize(directory / f) for f in files)
    full = total <= FULL_SCAN_BYTES
    for file in files:
        data_start = 8 + _header_length(directory / file)
        with open(directory / file, "rb") as fh:
            for name, t in sorted(headers[file].items(), key=lambda kv: kv[1]["data_offsets"][0]):
                size = _NONFINITE.get(t.get("dtype"), (0,))[0]
                if not size:
                    continue
                begin, end = (int(x) for x in t["data_offsets"])
                for offset, length in _windows(data_start + begin, end - begin, size, full):
                    fh.seek(offset)
                    if nonfinite_count(fh.read(length), t["dtype"]):
                        return file, name, full
    return None


def check_weights(directory: Path | str) -> None:
    """CheckpointError naming the file and tensor when a weight file is truncated or holds NaN/Inf."""
    found = first_nonfinite(directory)
    if found is not None:
        file, name, full = found
        how = "" if full else " (a sample of every tensor was read: the checkpoint is larger than " \
                              f"{FULL_SCAN_BYTES >> 20} MiB)"
        raise CheckpointError(f"{Path(directory) / file}: tensor {name!r} holds NaN or infinite values{how}")


_ONES = {"F32": struct.pack("<f", 1.0), "BF16": struct.pack("<f", 1.0)[2:], "F16": struct.pack("<e", 1.0),
         "F64": struct.pack("<d", 1.0)}


def norms_at_init(directory: Path | str) -> bool:
    """True when a checkpoint was never trained: its first normalisation weight (``*norm.weight``,
    a few KiB) is exactly 1.0 everywhere, as every family initialises it and no training leaves it.
    False for a trained checkpoint, one without such a tensor, or one that cannot be read (the other
    checks report that). Why: the launcher's pretrained learning-rate warning is noise for the random
    checkpoints users make to try ``model.path`` (docs/examples/byot/make_checkpoint.py)."""
    if not directory:
        return False
    directory = Path(directory).expanduser()
    try:
        files = weight_map(directory)
        name = next((n for n in sorted(files) if n.endswith("norm.weight")), None)
        if name is None:
            return False
        path = directory / files[name]
        t = read_st_header(path)[name]
        one = _ONES.get(t.get("dtype"))
        if one is None:
            return False
        begin, end = (int(x) for x in t["data_offsets"])
        with open(path, "rb") as f:
            f.seek(8 + _header_length(path) + begin)
            data = f.read(min(end - begin, 1 << 20))
    except (CheckpointError, OSError, KeyError, TypeError, ValueError):
        return False
    return len(data) > 0 and data == one * (len(data) // len(one))
