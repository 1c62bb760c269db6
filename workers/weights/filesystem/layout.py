"""Names and files of a published filesystem step, read by all three sides (torch-free).

The orchestrator reads index.json for the trainer's digest (:func:`index_digest`), the
publisher's retention follows its references (:func:`referenced_steps`); the layout itself
is described in the package docstring.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from workers.weights.digest import state_digest

INDEX = "index.json"
FORMAT = "slurmrl-weights/1"


def shard_name(rank: int, world: int, *, sharded: bool = False) -> str:
    """HF's names; ``sharded`` (delta mode) never uses ``model.safetensors`` (hf_layout.py says why)."""
    return "model.safetensors" if world == 1 and not sharded else f"model-{rank + 1:05d}-of-{world:05d}.safetensors"


def referenced_steps(step_dir: Path) -> set[str]:
    """Names of the earlier step dirs whose files ``step_dir``'s index points at."""
    try:
        weight_map = json.loads((step_dir / INDEX).read_text())["weight_map"]
    except (OSError, ValueError, KeyError):
        return set()
    return {f.split("/")[1] for f in weight_map.values() if f.startswith("../")}


def index_digest(step_dir: Path) -> Optional[str]:
    """:func:`state_digest` of a published step, from its index.json (None if unreadable)."""
    try:
        tensors = json.loads((Path(step_dir) / INDEX).read_text())["tensors"]
        return state_digest({n: m["xxh3"] for n, m in tensors.items()})
    except (OSError, ValueError, KeyError, TypeError):
        return None
