"""One version's changes as parts per tensor, and their wire form (one safetensors blob per sender).

A :class:`Part` is one sender's changes to one HF-named tensor: sorted flat positions inside that
tensor and the new values there, in the published dtype. A tensor sharded over trainer ranks gets
one part per rank that owns a piece of it (pieces never overlap: replicas are sent once).

Wire form, per sender and version (:func:`encode` / :func:`decode`): a safetensors blob holding, per
part ``k`` of tensor ``name``, ``{name}::{k}::val`` and either ``{name}::{k}::idx`` (sparse: int32
positions where the tensor has < 2**31 elements, else int64) or ``{name}::{k}::bits`` (bitmap:
uint8, bit j of the map (little-endian bit order) set when position lo + j changed). The smaller
encoding is chosen per part. Each part's entry in the sender's manifest records encoding, count,
lo, hi and an xxh3 of its bytes (positions then values), checked before anything is applied.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

import numpy as np
import torch
from safetensors.torch import load as st_load, save as st_save

from workers.weights.base import WeightLoadError
from workers.weights.checksums import xxh3_hex
from workers.weights.shards import dtype_from_name


@dataclasses.dataclass
class Part:
    """Changes to one tensor from one sender: ``positions`` (int64, sorted, unique) and ``values``."""

    positions: torch.Tensor
    values: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.positions.numel())


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()


def encode_part(name: str, k: int, part: Part, numel: int) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors for the blob, the part's manifest entry) of ``part`` of tensor ``name`` (``numel`` elements)."""
    pos = part.positions.detach().cpu().to(torch.int64)
    vals = part.values.detach().cpu().contiguous().reshape(-1)
    count = int(pos.numel())
    assert count == vals.numel() and count > 0, (name, count, vals.numel())
    lo, hi = int(pos[0]), int(pos[-1]) + 1
    idx_bytes = 4 if numel < 2**31 else 8
    key = f"{name}::{k}"
    if (hi - lo + 7) // 8 < count * idx_bytes:
        mask = np.zeros(hi - lo, dtype=np.bool_)
        mask[(pos - lo).numpy()] = True
        coded = torch.from_numpy(np.packbits(mask, bitorder="little"))
        encoding, tensors = "bitmap", {f"{key}::bits": coded}
    else:
        coded = pos.to(torch.int32 if idx_bytes == 4 else torch.int64)
        encoding, tensors = "sparse", {f"{key}::idx": coded}
    tensors[f"{key}::val"] = vals
    entry = {"key": key, "encoding": encoding, "count": count, "lo": lo, "hi": hi,
             "xxh3": xxh3_hex(np.concatenate([_np(coded), _np(vals)]))}
    return tensors, entry


def encode(parts: Mapping[str, list[Part]], numels: Mapping[str, int]) -> tuple[bytes, dict[str, list[dict]]]:
    """One sender's blob and its manifest ``{name: [part entries]}`` (tensors without changes are absent)."""
    tensors: dict[str, torch.Tensor] = {}
    manifest: dict[str, list[dict]] = {}
    for name, plist in parts.items():
        for k, p in enumerate(plist):
            if p.count == 0:
                continue
            t, entry = encode_part(name, k, p, numels[name])
            tensors.update(t)
            manifest.setdefault(name, []).append(entry)
    return (st_save(tensors) if tensors else b""), manifest


def decode(blob: bytes, manifest: Mapping[str, Iterable[dict]], *, dtypes: Mapping[str, str],
           where: str) -> dict[str, list[Part]]:
    """Parts of one sender's blob, every entry checked (keys, counts, bounds, xxh3); raises
    :class:`WeightLoadError` naming ``where`` and the tensor on the first problem."""
    try:
        tensors = st_load(blob) if blob else {}
    except Exception as e:  # safetensors raises its own error type on a truncated or garbled blob
        raise WeightLoadError(f"{where}: unreadable patch ({type(e).__name__}: {str(e)[:200]})") from None
    out: dict[str, list[Part]] = {}
    for name, entries in manifest.items():
        for e in entries:
            out.setdefault(name, []).append(decode_part(tensors, name, e, dtypes[name], where))
    return out


def decode_part(tensors: Mapping[str, torch.Tensor], name: str, e: dict, dtype: str, where: str) -> Part:
    """One part from its blob entries (``tensors``: at least this part's ``::val`` and ``::idx``/``::bits``),
    checked as :func:`decode` checks it; public so a reader can fetch only some parts' entries (an SGLang
    rank pulling the tensors it holds: workers/weights/sglang/patch_pull.py)."""
    try:
        key, enc, count, lo, hi = e["key"], e["encoding"], int(e["count"]), int(e["lo"]), int(e["hi"])
        vals = tensors[f"{key}::val"]
        coded = tensors[f"{key}::{'bits' if enc == 'bitmap' else 'idx'}"]
    except (KeyError, TypeError, ValueError) as err:
        raise WeightLoadError(f"{where}: patch of tensor {name} is missing {err}") from None
    if xxh3_hex(np.concatenate([_np(coded), _np(vals)])) != e.get("xxh3"):
        raise WeightLoadError(f"{where}: patch of tensor {name} fails its checksum (corrupt patch)")
    if str(vals.dtype).replace("torch.", "") != dtype or vals.numel() != count:
        raise WeightLoadError(f"{where}: patch of tensor {name} holds {vals.numel()} {vals.dtype} values, "
                              f"expected {count} {dtype}")
    if enc == "bitmap":
        mask = np.unpackbits(coded.numpy(), bitorder="little", count=hi - lo).astype(np.bool_)
        pos = torch.from_numpy(np.flatnonzero(mask)).to(torch.int64) + lo
    elif enc == "sparse":
        pos = coded.to(torch.int64)
    else:
        raise WeightLoadError(f"{where}: patch of tensor {name} has unknown encoding {enc!r}")
    if pos.numel() != count:
        raise WeightLoadError(f"{where}: patch of tensor {name} lists {pos.numel()} positions, expected {count}")
    return Part(pos, vals.reshape(-1))


def check_bounds(name: str, part: Part, numel: int, where: str) -> None:
    """Positions inside the tensor and strictly increasing (a malformed patch could write anywhere)."""
    pos = part.positions
    if pos.numel() and (int(pos[0]) < 0 or int(pos[-1]) >= numel or bool((pos[1:] <= pos[:-1]).any())):
        raise WeightLoadError(f"{where}: patch of tensor {name} has positions outside [0, {numel}) or out of order")


def value_dtype(name: str) -> torch.dtype:
    return dtype_from_name(name)
