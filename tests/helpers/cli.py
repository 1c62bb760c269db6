"""The slurmrl CLI as a subprocess with its own runs root (dry runs and plan errors)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.configs import REPO


def slurmrl(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "SLURMRL_RUNS_ROOT": str(tmp_path / "runs"), "PATH": str(Path(sys.executable).parent)}
    return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
