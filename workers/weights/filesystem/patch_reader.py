"""Filesystem transport, inference side of patch steps (``weights.delta``): which versions to apply.

Given the newest step V (a patch step) and the sum64 of every tensor the worker holds now:
  1. walk V's chain back (base pointers, every step's STABLE and index.json checked) to the newest
     step C whose sums equal the worker's: the worker holds C exactly; apply C+1..V in place
     (workers/weights/delta/apply.py: all or nothing, verified against each manifest);
  2. no such step down to the anchor A (a fresh or respawned worker, or one that refused a patch):
     read A in full (checksums as for any full step), apply A+1..V to the staged copy, verify, and
     hand the whole staged state over to be copied in.
A step the worker holds need not be on disk any more: when the chain walk cannot read a step (deleted or
damaged after the worker loaded it) and every tensor the patches above it leave alone already has its final
sum64 in the worker, the worker is taken to hold that step; applying then verifies every tensor they touch.
Every refusal (a missing or unstable step in the chain, a malformed index, an unreadable, truncated
or corrupt patch file, a digest mismatch after applying) is a WeightLoadError naming the step and the
tensor; the worker keeps the weights it had.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Mapping, Optional

import torch

from workers.common.protocol import STABLE, step_name
from workers.weights.base import Received, WeightLoadError, check_fits
from workers.weights.delta import DIGEST, FORMAT
from workers.weights.delta.apply import apply_chain
from workers.weights.delta.index import index_sums, patch_index_problem
from workers.weights.delta.patch import Part, decode
from workers.weights.delta.sum64 import hex64
from workers.weights.digest import state_digest
from workers.weights.filesystem.layout import INDEX
from workers.weights.shards import ShardError, open_regular

MAX_PATCH_INDEX_BYTES = 256 << 20


def read_index(step_dir: Path) -> dict:
    """A step's index.json after its STABLE marker (a regular file) is seen; WeightLoadError otherwise."""
    if not (step_dir / STABLE).is_file():
        raise WeightLoadError(f"{step_dir} has no {STABLE} marker: the patch chain is incomplete")
    try:
        with open_regular(step_dir / INDEX, INDEX) as f:
            if os.fstat(f.fileno()).st_size > MAX_PATCH_INDEX_BYTES:
                raise ValueError(f"over {MAX_PATCH_INDEX_BYTES} bytes")
            return json.loads(f.readall())
    except ShardError as e:
        raise WeightLoadError(str(e)) from None
    except (OSError, ValueError, RecursionError) as e:
        raise WeightLoadError(f"{step_dir / INDEX} is unreadable: {type(e).__name__}: {str(e)[:200]}") from None


def read_parts(step_dir: Path, index: dict) -> dict[str, list[Part]]:
    """Every part of one patch step, each file read once and every part checked (patch.decode)."""
    by_file: dict[str, dict[str, list[dict]]] = {}
    for n, m in index["tensors"].items():
        for p in m["parts"]:
            by_file.setdefault(p["file"], {}).setdefault(n, []).append(p)
    dtypes = {n: m["dtype"] for n, m in index["tensors"].items()}
    out: dict[str, list[Part]] = {}
    for fname, manifest in by_file.items():
        try:
            with open_regular(step_dir / fname, fname) as f:
                blob = f.readall()
        except (ShardError, OSError) as e:
            raise WeightLoadError(f"{step_dir / fname}: {e}") from None
        for n, parts in decode(blob, manifest, dtypes=dtypes, where=str(step_dir / fname)).items():
            out.setdefault(n, []).extend(parts)
    return out


def holds_base(held: Mapping[str, int], chain: list[tuple[Path, dict]]) -> bool:
    """Whether sums ``held`` fit the base of ``chain`` (newest first) without reading the base: every
    tensor no patch of the chain touches already has its final sum64 (the touched ones are checked as
    they are applied, apply.py)."""
    final = index_sums(chain[0][1]) or {}
    touched = {n for _, ix in chain for n, m in ix["tensors"].items() if m["parts"]}
    return set(held) == set(final) and all(held[n] == v for n, v in final.items() if n not in touched)


def load_patch_step(step_dir: Path, index: dict, *, expected: Optional[Mapping[str, torch.Tensor]],
                    sums: Optional[Mapping[str, int]],
                    load_full: Callable[[Path], Received]) -> Received:
    """What a worker holding ``sums`` must apply to serve ``step_dir`` (module docstring).
    ``load_full(anchor_dir)`` reads a full step (the DiskReader's own path)."""
    problem = patch_index_problem(index)
    if problem:
        raise WeightLoadError(f"{step_dir / INDEX} is malformed: {problem}"[:500])
    if expected is not None:
        check_fits(index["tensors"], expected, where=str(step_dir))
    root = step_dir.parent
    chain = [(step_dir, index)]  # newest first
    held = dict(sums) if sums else None
    while True:
        base = chain[-1][1]["base"]
        base_dir = root / step_name(base)
        try:
            base_index = read_index(base_dir)
        except WeightLoadError:
            if held is not None and holds_base(held, chain):  # the worker holds it; its files went since
                start = "held"
                break
            raise
        if held is not None and index_sums(base_index) == held:
            start = "held"
            break
        if base == index["anchor"]:
            start = "anchor"
            break
        if base_index.get("format") != FORMAT or (p := patch_index_problem(base_index)):
            raise WeightLoadError(f"{base_dir / INDEX}: the chain of {step_dir.name} is broken "
                                  f"({p if base_index.get('format') == FORMAT else 'not a patch step'})")
        chain.append((base_dir, base_index))
    chain.reverse()
    patches = [(read_parts(d, ix), index_sums(ix), str(d)) for d, ix in chain]
    final = index_sums(index)
    digest = state_digest({n: hex64(v) for n, v in final.items()})
    nbytes = sum(p.values.numel() * p.values.element_size() + p.positions.numel() * 8
                 for parts, _, _ in patches for ps in parts.values() for p in ps)
    if start == "held":
        return Received(state={}, hashes=None, bytes=nbytes, seconds=0.0, num_skipped=len(final),
                        patches=patches, sums=held, digest=digest)
    anchor_dir = root / step_name(index["anchor"])
    full = load_full(anchor_dir)
    anchor_sums = index_sums(read_index(anchor_dir))
    if anchor_sums is None:
        raise WeightLoadError(f"{anchor_dir / INDEX} has no {DIGEST} per tensor: not the anchor of a patch chain")
    full.sums = apply_chain(full.state, patches, anchor_sums)  # on the staged copy: nothing live changes
    full.hashes, full.digest, full.bytes = None, digest, full.bytes + nbytes
    return full
