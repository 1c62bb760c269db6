"""Where a benchmark writes: an ignored scratch folder by default, the tracked record only when asked.

Why: benchmarks/results/ is the project's record of measurements (indexed, with command, device
and date, in benchmarks/results/README.md). A benchmark run to try something must not rewrite it,
so every benchmark writes to ``benchmarks/out/`` (in .gitignore) unless its command line has
``--record``::

    python -m benchmarks.weight_sync              # -> benchmarks/out/weight_sync.json
    python -m benchmarks.weight_sync --record     # -> benchmarks/results/weight_sync.json

``--record`` is read (and taken off ``sys.argv``) here, when a benchmark module computes its output
folder at import, so each benchmark's own argument parser never sees it; ``--out`` still wins
where a benchmark has it. Temporary files always go under ``benchmarks/out/`` (:data:`SCRATCH`),
so an interrupted run leaves nothing in the record. After recording, add the file's row to the
index in benchmarks/results/README.md (test_results_index.py fails on a file without one).
"""
from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
RECORDED = BENCHMARKS / "results"
"""The tracked record (benchmarks/results/)."""
SCRATCH = BENCHMARKS / "out"
"""Ignored output of ordinary runs and every benchmark's temporary files (benchmarks/out/)."""
RECORD_FLAG = "--record"

_recording = RECORD_FLAG in sys.argv[1:]
if _recording:
    sys.argv = [a for a in sys.argv if a != RECORD_FLAG]


def recording() -> bool:
    """Whether this process was started with ``--record``."""
    return _recording


def results_dir(sub: str = "") -> Path:
    """benchmarks/results/<sub> with ``--record``, else benchmarks/out/<sub>; created if missing."""
    path = (RECORDED if _recording else SCRATCH) / sub
    path.mkdir(parents=True, exist_ok=True)
    return path


def scratch_dir(name: str) -> Path:
    """A temporary folder for one benchmark's rank files, always under benchmarks/out/."""
    path = SCRATCH / name
    path.mkdir(parents=True, exist_ok=True)
    return path
