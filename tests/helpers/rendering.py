"""Rendering sbatch scripts for golden files and reading their blocks and srun steps."""
from __future__ import annotations

from pathlib import Path

from launcher.plan import build_plan
from launcher.render import render_script
from tests.helpers.configs import compose

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


PATHS = dict(run_dir="/RUN_DIR", python="/VENV/bin/python", workdir="/WORKDIR", script_path="/RUN_DIR/slurm/job.sbatch")


def render(overrides: list[str], **changes) -> str:
    cfg = compose(overrides)
    for key, value in changes.items():
        setattr(cfg.cluster, key, value)
    return render_script(build_plan(cfg), **PATHS)


def sbatch_blocks(text: str) -> list[list[str]]:
    blocks: list[list[str]] = [[]]
    for line in text.splitlines():
        if line == "#SBATCH hetjob":
            blocks.append([])
        elif line.startswith("#SBATCH "):
            blocks[-1].append(line[len("#SBATCH "):])
    return blocks


def srun_steps(text: str) -> list[list[str]]:
    """The flags of every srun step (one flag per continued line)."""
    steps, cur = [], None
    for line in text.splitlines():
        s = line.strip()
        if s == "srun \\":
            cur = []
        elif cur is not None and s.startswith("--"):
            cur.append(s.rstrip(" \\"))
        elif cur is not None:
            steps.append(cur)
            cur = None
    return steps
