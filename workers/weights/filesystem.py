"""Filesystem weight transport: trainer publishes ``weights/step_N/``, inference loads it.

Layout of one step (see workers.common.protocol): ``model.safetensors`` (HF names),
``index.json`` = {"step", "weight_map": {name: file}, "tensors": {name: {shape, dtype,
xxh64}}}, then ``STABLE``. The directory appears by rename, so readers never see a
partial step. :func:`load_step` verifies every tensor's checksum and shape and raises
:class:`WeightLoadError` (message names the tensor/file) instead of returning bad weights.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Mapping, Optional

import torch
import xxhash
from safetensors.torch import load_file, save_file

from workers.common.protocol import STABLE, publish_dir, step_name

SHARD = "model.safetensors"
INDEX = "index.json"


class WeightLoadError(RuntimeError):
    """A weight step is missing, partial, corrupt or does not fit the model."""


def tensor_hash(t: torch.Tensor) -> str:
    """xxh64 of the tensor's raw bytes (bit-exact comparison across processes)."""
    t = t.detach().contiguous().cpu()
    return xxhash.xxh64(t.view(torch.uint8).numpy() if t.dtype != torch.uint8 else t.numpy()).hexdigest()


def _tensor_meta(state: Mapping[str, torch.Tensor]) -> dict:
    return {n: {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""), "xxh64": tensor_hash(t)}
            for n, t in state.items()}


def publish_step(weights_root: Path, step: int, state: Mapping[str, torch.Tensor], *, keep_last: int) -> dict:
    """Write step ``step`` atomically and prune old steps. Returns {bytes, seconds}."""
    t0 = time.perf_counter()
    state = {n: t.detach().contiguous().cpu() for n, t in state.items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())

    def write(tmp: Path) -> None:
        save_file(dict(state), str(tmp / SHARD), metadata={"format": "pt"})
        index = {"step": step, "weight_map": {n: SHARD for n in state}, "tensors": _tensor_meta(state)}
        (tmp / INDEX).write_text(json.dumps(index))

    weights_root.mkdir(parents=True, exist_ok=True)
    publish_dir(weights_root / step_name(step), write, STABLE)
    prune(weights_root, keep_last=keep_last, newest=step)
    return {"bytes": nbytes, "seconds": time.perf_counter() - t0}


def prune(weights_root: Path, *, keep_last: int, newest: int) -> None:
    """Delete published steps older than the newest ``keep_last`` (step 0 included)."""
    for d in weights_root.iterdir():
        if d.name.startswith("step_") and int(d.name[5:]) <= newest - keep_last:
            shutil.rmtree(d, ignore_errors=True)


def load_step(step_dir: Path, expected: Optional[Mapping[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
    """Read and verify a published step. ``expected`` (current params) checks names/shapes."""
    step_dir = Path(step_dir)
    if not step_dir.is_dir():
        raise WeightLoadError(f"weight directory {step_dir} does not exist")
    if not (step_dir / STABLE).exists():
        raise WeightLoadError(f"{step_dir} has no {STABLE} marker: the publisher has not finished it")
    try:
        index = json.loads((step_dir / INDEX).read_text())
    except (OSError, ValueError) as e:
        raise WeightLoadError(f"{step_dir / INDEX} is unreadable: {e}") from e
    state: dict[str, torch.Tensor] = {}
    for fname in sorted(set(index["weight_map"].values())):
        try:
            state.update(load_file(str(step_dir / fname)))
        except Exception as e:  # safetensors raises several types for truncated files
            raise WeightLoadError(f"shard {step_dir / fname} is unreadable ({type(e).__name__}: {e})") from e
    for name, meta in index["tensors"].items():
        if name not in state:
            raise WeightLoadError(f"tensor {name} listed in {INDEX} is missing from the shards of {step_dir}")
        t = state[name]
        if list(t.shape) != meta["shape"]:
            raise WeightLoadError(f"tensor {name}: shard shape {list(t.shape)} != index shape {meta['shape']}")
        if tensor_hash(t) != meta["xxh64"]:
            raise WeightLoadError(f"tensor {name} in {step_dir} fails its checksum (corrupt shard)")
    if expected is not None:
        missing = sorted(set(expected) - set(state))
        if missing:
            raise WeightLoadError(f"{step_dir} lacks {len(missing)} model tensors, e.g. {missing[:3]}")
        for name, cur in expected.items():
            if tuple(cur.shape) != tuple(state[name].shape):
                raise WeightLoadError(f"tensor {name}: published shape {tuple(state[name].shape)} != model shape {tuple(cur.shape)}")
    return state
