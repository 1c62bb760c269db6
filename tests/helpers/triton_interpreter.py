"""Run a script under Triton's CPU interpreter: how the Triton kernels are tested on a machine with no GPU.

The interpreter flag (``TRITON_INTERPRET=1``) is read when a kernel is first defined, so the script
runs in a fresh interpreter process with the repository on its path; it must print ``ok`` last.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def assert_ok_under_interpreter(script: str, timeout: float = 600) -> None:
    """Run ``script`` with ``TRITON_INTERPRET=1``; fail with its stderr unless it exits 0 printing ``ok``."""
    import triton  # noqa: F401  (installed by `make test`: a missing one fails here, never skips)

    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
