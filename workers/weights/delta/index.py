"""The index of a patch step (``weights.delta``): what its index.json says, and when it is malformed.

Every reader of a patch step checks the same schema before reading any of its files: the filesystem
transport's workers (workers/weights/filesystem/patch_reader.py: the chain back to what a worker holds),
and an SGLang rank pulling its share (workers/weights/sglang/patch_pull.py). The writer is
workers/weights/filesystem/patch_publisher.py. One step's index.json::

    {"format": "slurmrl-delta/1", "step": V, "base": B, "anchor": A,      anchor <= base < step
     "tensors": {name: {"shape", "dtype", "sum64" (hex, after V),
                        "parts": [{"file", "key", "encoding", "count", "lo", "hi", "xxh3"}]}},
     "stats": {"changed", "compared", "bytes", "dense_bytes"}}

An anchor is an ordinary full step whose index.json adds ``anchor`` and every tensor's ``sum64``
(:func:`index_sums` reads both kinds).
"""
from __future__ import annotations

from typing import Optional

from workers.weights.delta import DIGEST, FORMAT
from workers.weights.shards import BY_NAME


def is_patch_index(index) -> bool:
    """Is this parsed index.json a patch step's (else a full step's)?"""
    return isinstance(index, dict) and index.get("format") == FORMAT


def index_sums(index: dict) -> Optional[dict[str, int]]:
    """Every tensor's sum64 after a step (anchor or patch), None when the index has none."""
    try:
        return {n: int(m[DIGEST], 16) for n, m in index["tensors"].items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def patch_index_problem(index: dict) -> str:
    """What is wrong with a patch step's index.json ("": nothing), before any of its files is read."""
    if not (isinstance(index, dict) and index.get("format") == FORMAT):
        return "not a patch index"
    if not all(type(index.get(k)) is int and index[k] >= 0 for k in ("step", "base", "anchor")):
        return "step, base and anchor must be non-negative integers"
    if not index["anchor"] <= index["base"] < index["step"]:
        return f"needs anchor <= base < step, got {index['anchor']}, {index['base']}, {index['step']}"
    tensors = index.get("tensors")
    if not isinstance(tensors, dict):
        return "tensors must be an object"
    for n, m in tensors.items():
        if not (isinstance(m, dict) and m.get("dtype") in BY_NAME and isinstance(m.get("shape"), list)
                and isinstance(m.get(DIGEST), str) and isinstance(m.get("parts"), list)
                and all(isinstance(p, dict) and isinstance(p.get("file"), str) and "/" not in p["file"]
                        for p in m["parts"])):
            return f"tensors[{n!r}] must be {{shape, dtype, {DIGEST}, parts: [{{file, ...}}]}}"
    if index_sums(index) is None:
        return f"every tensor's {DIGEST} must be 16 hex digits"
    return ""
