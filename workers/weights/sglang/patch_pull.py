"""Per-rank pull of a patch step: an SGLang rank reads from shared storage only the patch bytes of what it holds.

Why: over ``weights.transport=broadcast`` every rank of every SGLang server receives the WHOLE patch
(SGLang 0.5.23 gives every member of its update group the same bytes: patch_cost.py), although an EP rank
holds only ``1/ep`` of the routed experts, which are most of a MoE model. With
``weights.transport=filesystem`` the patch step is already on shared storage, one safetensors file per
trainer rank in which every part of every tensor is its own entry (``{name}::{k}::val`` plus ``::idx`` or
``::bits``: workers/weights/delta/patch.py). So the orchestrator posts only a descriptor naming the step
(workers/weights/sglang/pull_coordinator.py) and each rank's custom weight loader
(workers/weights/sglang/patch_loader.py) asks :func:`read_held_parts` for the tensors it holds:
the file's header once, then one ``pread`` per entry of those tensors. Nothing else of the file is touched,
and the bytes counted are the bytes ``pread`` returned (the verdict reports them; tests compare them with
the rank's share of the step).

Every entry is checked as a whole-file read checks it (key present, count, bounds, xxh3 of positions and
values: patch.decode_part); any problem raises WeightLoadError naming the file and the tensor, before
anything is applied.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Collection, Mapping

import torch

from workers.weights.base import WeightLoadError
from workers.weights.delta.patch import Part, decode_part
from workers.weights.delta.index import patch_index_problem
from workers.weights.filesystem.patch_reader import read_index
from workers.weights.shards import FROM_ST, ShardError, open_regular, read_header


class PatchFile:
    """One patch file opened for selective reads (its header parsed and checked once: shards.read_header)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.f = open_regular(path, "patch file")
            self.header, self.data_start = read_header(path, self.f)
        except ShardError as e:
            raise WeightLoadError(str(e)) from None
        self.header_bytes = self.data_start
        self.bytes_read = 0
        """Bytes of tensor data read so far (headers not counted: ``header_bytes``)."""

    def tensor(self, key: str) -> torch.Tensor:
        """The entry ``key``, read with one pread of exactly its bytes."""
        h = self.header.get(key)
        if h is None:
            raise WeightLoadError(f"{self.path}: no entry {key!r} (the index names a part this file lacks)")
        dtype = FROM_ST.get(h.get("dtype"))
        if dtype is None:
            raise WeightLoadError(f"{self.path}: entry {key!r} has unknown dtype {h.get('dtype')!r}")
        begin, end = h["data_offsets"]
        data = bytearray()
        while len(data) < end - begin:
            got = os.pread(self.f.fileno(), end - begin - len(data), self.data_start + begin + len(data))
            if not got:
                raise WeightLoadError(f"{self.path}: entry {key!r} is truncated")
            data += got
        self.bytes_read += len(data)
        if not data:
            return torch.empty(h["shape"], dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).reshape(h["shape"])

    def close(self) -> None:
        self.f.close()


def entry_keys(part: Mapping) -> tuple[str, str]:
    """The two safetensors entries of one part (values, then positions or bitmap)."""
    return f"{part['key']}::val", f"{part['key']}::{'bits' if part.get('encoding') == 'bitmap' else 'idx'}"


def read_held_parts(step_dir: Path, index: dict, held: Collection[str]) -> tuple[dict[str, list[Part]], int]:
    """The parts of the tensors in ``held`` (HF names) from patch step ``step_dir`` whose index.json is
    ``index``; returns (parts by tensor, tensor bytes read). Other tensors' entries are never read."""
    by_file: dict[str, list[tuple[str, dict]]] = {}
    for name in held:
        for p in index["tensors"][name]["parts"]:
            by_file.setdefault(p["file"], []).append((name, p))
    out: dict[str, list[Part]] = {}
    nread = 0
    for fname, wanted in sorted(by_file.items()):
        pf = PatchFile(step_dir / fname)
        try:
            for name, p in wanted:
                entries = {k: pf.tensor(k) for k in entry_keys(p)}
                where = str(step_dir / fname)
                out.setdefault(name, []).append(decode_part(entries, name, p, index["tensors"][name]["dtype"], where))
        finally:
            pf.close()
        nread += pf.bytes_read
    return out, nread


def read_patch_index(step_dir: Path, version: int, base: int) -> dict:
    """Patch step ``step_dir``'s index.json, checked to be the patch of ``version`` on ``base`` the
    descriptor announced (a step rewritten since, or a full step, is refused by name)."""
    index = read_index(step_dir)
    problem = patch_index_problem(index)
    if problem:
        raise WeightLoadError(f"{step_dir}/index.json: {problem}")
    if (index["step"], index["base"]) != (version, base):
        raise WeightLoadError(f"{step_dir} is the patch of v{index['step']} on v{index['base']}, the orchestrator "
                              f"announced v{version} on v{base}")
    return index
