"""One durable, atomic way to publish a directory: readers see all of it, with its marker, or nothing.

Why one helper: four writers (rollout batches and LoRA steps through :func:`publish_dir`, the filesystem
transport's full and patch steps, the trainer's checkpoints) each did "write into a temp dir, mark it,
rename", and only two fsynced the directories, so after a power loss or a node crash a marker could
survive while the files it vouches for, or the rename itself, did not.

The sequence (:func:`seal`), after the payload is in ``temp_dir(final)`` (same parent, so the rename is
atomic on one filesystem):
  1. fsync every file under the temp dir, then every directory under it (names are durable too);
  2. write the marker (JSON: the caller's fields + ``time``), fsync it and the temp dir;
  3. rename the temp dir to ``final`` (an existing ``final`` is removed first, unless ``replace=False``:
     then a ``final`` another writer published first makes the rename fail with OSError, and it is kept);
  4. fsync the parent, which makes the rename durable.
A writer that dies before step 3 leaves only the hidden ``.<name>.tmp`` dir: no reader looks there, and
the next publish of that name starts it afresh (``temp_dir(final, fresh=True)``).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional


def temp_path(final: Path) -> Path:
    """``.<name>.tmp`` beside ``final``: hidden from readers, on the same filesystem as ``final``."""
    return final.parent / f".{final.name}.tmp"


def temp_dir(final: Path, *, fresh: bool = False) -> Path:
    """:func:`temp_path`, created (with its parents); ``fresh``: emptied first."""
    tmp = temp_path(final)
    if fresh:
        shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True, exist_ok=True)
    return tmp


def fsync_path(path: Path) -> None:
    """fsync one file or directory (a directory's fsync makes its entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    """Write ``path`` and fsync it before returning."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def seal(tmp: Path, final: Path, marker: str, fields: Optional[Mapping[str, Any]] = None, *,
         replace: bool = True) -> None:
    """Make the filled ``tmp`` visible as ``final`` with ``marker`` in it, durably (module docstring)."""
    dirs = []
    for root, subdirs, files in os.walk(tmp):
        for name in files:
            fsync_path(Path(root) / name)
        dirs += [Path(root) / d for d in subdirs]
    for d in dirs:
        fsync_path(d)
    write_synced(tmp / marker, json.dumps({**(fields or {}), "time": time.time()}).encode())
    fsync_path(tmp)
    if replace and final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_path(final.parent)


def publish_dir(final: Path, write: Callable[[Path], None], marker: str) -> None:
    """One writer: ``write(tmp_dir)`` creates the payload files in a fresh temp dir, then :func:`seal`."""
    tmp = temp_dir(final, fresh=True)
    write(tmp)
    seal(tmp, final, marker)
