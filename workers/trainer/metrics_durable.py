"""metrics.jsonl survives what a checkpoint survives (issue 47 item 4).

Why: a resume keeps the metrics records of the steps its checkpoint holds and redoes the later ones.
A record that was only flushed (not synced) when the checkpoint was written, or a last line cut later,
lost that step for good: the resume starts after it and nobody writes it again. So when rank 0 saves
checkpoint S it syncs metrics.jsonl (every line up to S is on disk as surely as the checkpoint) and
appends S's record to ``checkpoints/metrics_at_checkpoints.jsonl`` (synced too); a resume from S puts
back any record of a checkpointed step <= S that metrics.jsonl lacks or holds torn.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

BACKUP_FILE = "metrics_at_checkpoints.jsonl"
TAIL_BYTES = 8 << 20
"""How much of metrics.jsonl's end is read for the checkpointed step's record (a record with logged
samples is a few KB)."""


def _record_of(line: str) -> Optional[dict]:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and type(rec.get("step")) is int else None


def keep_record(metrics: Path, checkpoints: Path, step: int) -> bool:
    """Rank 0, when checkpoint ``step`` is saved: sync metrics.jsonl and keep a synced copy of step's
    record beside the checkpoints; False when metrics.jsonl holds no record of ``step`` (nothing kept)."""
    try:
        with open(metrics, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - TAIL_BYTES))
            tail = f.read().decode("utf-8", errors="replace")
            os.fsync(f.fileno())
    except OSError:
        return False
    found = [r for r in map(_record_of, tail.splitlines()) if r is not None and r["step"] == step]
    if not found:
        return False
    backup = checkpoints / BACKUP_FILE
    with open(backup, "a", encoding="utf-8") as f:
        f.write(json.dumps(found[-1], sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return True


def restore_records(kept: list[str], checkpoints: Path, step: int) -> tuple[list[str], list[int]]:
    """``kept``: metrics.jsonl's lines of steps <= ``step`` (a resume from checkpoint ``step``). Adds the
    kept copy of every checkpointed step <= ``step`` that they lack, in step order; returns (lines, steps
    put back)."""
    try:
        saved = (checkpoints / BACKUP_FILE).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return kept, []
    have = {r["step"] for r in map(_record_of, kept) if r is not None}
    back: dict[int, str] = {}
    for line in saved:
        rec = _record_of(line)
        if rec is not None and rec["step"] <= step and rec["step"] not in have:
            back[rec["step"]] = line
    if not back:
        return kept, []
    lines = [(r["step"] if (r := _record_of(ln)) is not None else -1, ln) for ln in kept]
    lines += list(back.items())
    return [ln for _, ln in sorted(lines, key=lambda x: x[0])], sorted(back)
