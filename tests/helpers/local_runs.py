"""The CLI as a whole local run: small overrides, metrics, no process left behind."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path


from tests.helpers.configs import REPO



SMALL = ["orchestrator.num_prompts_per_step=4", "orchestrator.num_samples_per_prompt=4",
         "orchestrator.max_inflight_rollouts=32"]


def slurmrl(args: list[str], tmp_path: Path, *, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "launcher", f"cluster.runs_root={tmp_path / 'runs'}", *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"slurmrl failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def assert_no_children_left(run_dir: Path) -> None:
    pids = json.loads((run_dir / "pids.json").read_text())["children"]
    deadline = time.monotonic() + 15
    alive = {}
    while time.monotonic() < deadline:
        alive = {name: pid for name, pid in pids.items() if _alive(pid)}
        if not alive:
            return
        time.sleep(0.2)
    raise AssertionError(f"children still alive after the launcher exited: {alive}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
