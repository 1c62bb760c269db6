"""Names and files of a published filesystem step, read by all three sides (torch-free).

The orchestrator reads index.json for the trainer's digest (:func:`index_digest`), the
publisher's retention follows its references (:func:`referenced_steps`); the layout itself
is described in the package docstring.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from workers.common.protocol import is_marked, step_name
from workers.weights.delta import DIGEST, FORMAT as DELTA_FORMAT
from workers.weights.digest import state_digest

INDEX = "index.json"
FORMAT = "slurmrl-weights/1"


def shard_name(rank: int, world: int, *, sharded: bool = False) -> str:
    """HF's names; ``sharded`` (delta mode) never uses ``model.safetensors`` (hf_layout.py says why)."""
    return "model.safetensors" if world == 1 and not sharded else f"model-{rank + 1:05d}-of-{world:05d}.safetensors"


def referenced_steps(step_dir: Path) -> set[str]:
    """Names of the earlier step dirs ``step_dir`` needs: those its index points at (``weights.delta_files``),
    or, for a patch step (``weights.delta``), its anchor and every step after it (the patch chain)."""
    try:
        index = json.loads((step_dir / INDEX).read_text())
        if index.get("format") == DELTA_FORMAT:
            return {step_name(s) for s in range(int(index["anchor"]), int(index["step"]))}
        weight_map = index["weight_map"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return set()
    return {f.split("/")[1] for f in weight_map.values() if f.startswith("../")}


def index_digest(step_dir: Path) -> Optional[str]:
    """:func:`state_digest` of a published step, from its index.json (None if unreadable): of the
    xxh3s for a full step, of the sum64s for a patch step (what a worker reports after applying it)."""
    try:
        index = json.loads((Path(step_dir) / INDEX).read_text())
        key = DIGEST if index.get("format") == DELTA_FORMAT else "xxh3"
        return state_digest({n: m[key] for n, m in index["tensors"].items()})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def stable_versions(weights_root: Path) -> list[int]:
    """Published versions (``step_N`` with a STABLE file), newest first (torch-free)."""
    try:
        names = [d.name for d in weights_root.iterdir()]
    except OSError:
        return []
    return sorted((int(n[5:]) for n in names if n.startswith("step_") and n[5:].isdigit()
                   and is_marked(weights_root / n)), reverse=True)
