"""What a run directory says about itself, without Slurm: state, progress, and the next commands.

Used by ``slurmrl status RUN`` for runs that were not submitted to Slurm (local and dry runs),
by ``slurmrl status --all`` for the state column of those runs, and by the launcher's finish and
Ctrl-C lines (:func:`next_commands`: resume, TensorBoard, eval, plot).

States of a run directory without ``slurm/job_id``:
  DRY RUN       written by ``launcher.dry_run=true`` (a ``DRY_RUN`` marker) and never started
  RUNNING       the local launcher that started it is alive (``pids.json``)
  FINISHED      the trainer wrote its last step (``TRAINER_DONE``)
  STOPPED       steps were logged, the launcher is gone, the trainer did not finish (resume it)
  NOT STARTED   nothing logged and no launcher alive
"""
from __future__ import annotations

import json
import math
import os
import shlex
from pathlib import Path
from typing import Optional

from launcher.timeline import summary_line
from workers.common.protocol import RunPaths

DRY_RUN_MARKER = "DRY_RUN"


def mark_dry_run(root: Path) -> None:
    (Path(root) / DRY_RUN_MARKER).write_text("written by launcher.dry_run=true; nothing was started\n")


def records(paths: RunPaths) -> list[dict]:
    """The step records of metrics.jsonl: JSON objects with an integer ``step``. Anything else (a line being
    written, bytes that are not UTF-8, a line that is not an object or has no step, an unreadable file) is
    skipped, so status and plot never stop on a damaged file."""
    try:
        text = paths.metrics.read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            continue  # a line being written
        if isinstance(rec, dict) and type(rec.get("step")) is int:
            out.append(rec)
    return out


def trained(recs: list[dict]) -> list[dict]:
    """The trainer's step records (not the final weights' eval record: workers/orchestrator/final_eval.py)."""
    return [r for r in recs if not r.get("final_eval")]


def launcher_alive(root: Path) -> bool:
    try:
        pid = int(json.loads((Path(root) / "pids.json").read_text())["launcher"])
        os.kill(pid, 0)
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def local_state(root: Path, steps: int) -> str:
    paths = RunPaths(root)
    if (Path(root) / DRY_RUN_MARKER).exists() and not steps:
        return "DRY RUN"
    if paths.trainer_done.exists():
        return "FINISHED"
    if launcher_alive(root):
        return "RUNNING"
    return "STOPPED" if steps else "NOT STARTED"


def finite(value) -> Optional[float]:
    try:
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None
    except OverflowError:  # an int too large for a float
        return None


def last_eval(recs: list[dict]) -> Optional[tuple[float, int]]:
    """(eval reward, the step whose weights it evaluated) of the last evaluation."""
    for r in reversed(recs):
        if finite(r.get("eval/reward")) is not None:
            at = r.get("eval/weights_step", r.get("eval/policy_version", r["step"]))
            return float(r["eval/reward"]), at if type(at) is int else r["step"]
    return None


def num_steps_of(root: Path) -> Optional[int]:
    """trainer.num_steps from config/run.yaml (a plain text scan: no config classes needed)."""
    try:
        text = (Path(root) / "config" / "run.yaml").read_text()
    except (OSError, ValueError):
        return None
    section = text.split("\ntrainer:\n", 1)[-1]
    for line in section.splitlines():
        if line.strip().startswith("num_steps:"):
            try:
                return int(line.split(":", 1)[1])
            except ValueError:
                return None
    return None


def latest_weights(root: Path) -> Optional[Path]:
    """The newest published step (``weights/step_N`` with its STABLE marker)."""
    steps = sorted((p for p in (Path(root) / "weights").glob("step_*") if (p / "STABLE").exists()),
                   key=lambda p: p.name)
    return steps[-1] if steps else None


def next_commands(root: Path, *, finished: bool) -> list[str]:
    """The commands a user wants next: resume (unless finished), TensorBoard, eval of the newest
    published weights (when the env has an eval split: the user knows; we show it when weights exist), plot,
    and the upload of an offline W&B run (``wandb sync``, where wandb wrote one)."""
    q = shlex.quote(str(root))
    out = [] if finished else [f"resume:      slurmrl resume {q}"]
    out.append(f"TensorBoard: tensorboard --logdir {shlex.quote(str(RunPaths(root).tb_dir))}")
    weights = latest_weights(root)
    if weights is not None:
        out.append(f"eval:        slurmrl-eval {shlex.quote(str(weights))}")
    out.append(f"plot:        slurmrl plot {q}")
    offline = sorted((Path(root) / "wandb").glob("offline-run-*"))  # tracking.wandb_mode=offline
    if offline:
        out.append(f"W&B:         wandb sync {shlex.quote(str(offline[-1]))}")
    return out


def describe_local(root: Path) -> list[str]:
    """``slurmrl status RUN`` for a run that was not submitted to Slurm."""
    paths = RunPaths(root)
    recs = records(paths)
    steps = trained(recs)
    state = local_state(root, len(steps))
    total = num_steps_of(root)
    lines = [f"run {root}: {state} (not submitted to Slurm)"]
    if state == "DRY RUN":
        script = Path(root) / "slurm" / "job.sbatch"
        lines.append(f"  written by launcher.dry_run=true: config in {paths.run_config}"
                     + (f"; submit with: sbatch --parsable {script}" if script.exists() else ""))
        return lines
    reward = finite(steps[-1].get("reward_mean")) if steps else None
    lines.append(f"  step {len(steps)}{f'/{total}' if total else ''}"
                 + (f", last reward {reward:.3f}" if reward is not None else ""))
    ev = last_eval(recs)
    if ev:
        lines.append(f"  last eval {ev[0]:.3f} (weights of step {ev[1]})")
    if (timeline := summary_line(root)) is not None:
        lines.append(f"  {timeline}")
    lines.append(f"  logs {paths.logs_dir}")
    lines += [f"  {c}" for c in next_commands(root, finished=state == "FINISHED")]
    return lines
