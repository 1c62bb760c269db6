"""Slurm backend: submit the rendered hetjob, then (by default) follow it until it ends.

Following prints the same one-line-per-step progress as the local backend (read from
run_dir/metrics.jsonl, which the trainer writes on the shared filesystem) plus a line per
job-state change. Ctrl-C stops following, never the job: ``slurmrl cancel RUN_DIR`` does.
Also the ``slurmrl status|cancel [RUN_DIR|JOB_ID]`` commands.
"""
from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Optional

from launcher import submit
from launcher.progress import ProgressPrinter
from workers.common.protocol import RunPaths

POLL_S = 2.0


def batch_log(run_dir: Path, job_id: str) -> Path:
    return Path(run_dir) / "logs" / f"slurm-{job_id}.out"


def tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as e:
        return f"(cannot read {path}: {e})"


class _Interrupted(Exception):
    pass


def follow(job_id: str, paths: RunPaths, num_steps: int, *, poll_s: float = POLL_S) -> int:
    """Print progress until the job ends. 0 if every component COMPLETED, 1 if not, 130 on Ctrl-C."""
    progress = ProgressPrinter(paths, num_steps)
    last = None

    def interrupt(_signum, _frame):
        raise _Interrupted

    old = signal.signal(signal.SIGINT, interrupt)
    try:
        while True:
            comps = submit.components(job_id)
            now = submit.describe(comps)
            if now != last:
                print(f"[slurmrl] job {job_id}: {now}", flush=True)
                last = now
            progress.poll()
            if not any(c.state in submit.ACTIVE for c in comps):
                break
            time.sleep(poll_s)
    except _Interrupted:
        print(f"\n[slurmrl] stopped following; job {job_id} keeps running. "
              f"`slurmrl status {paths.root}` or `slurmrl cancel {paths.root}`", flush=True)
        return 130
    finally:
        signal.signal(signal.SIGINT, old)
    progress.poll()
    state = submit.overall_state(comps)
    print(f"[slurmrl] job {job_id} ended {state}: {progress.summary()}", flush=True)
    if state != "COMPLETED":
        log = batch_log(paths.root, job_id)
        print(f"[slurmrl] last lines of {log}:\n{tail(log)}", flush=True)
        return 1
    return 0


def resolve(target: Optional[str]) -> tuple[str, Optional[Path]]:
    """A job id, a run dir (with slurm/job_id) or, by default, runs/latest -> (job id, run dir)."""
    if target and target.isdigit():
        return target, None
    run_dir = Path(target or "runs/latest").expanduser().resolve()
    return submit.read_job_id(run_dir), run_dir


def status(target: Optional[str]) -> int:
    job_id, run_dir = resolve(target)
    comps = submit.components(job_id)
    print(f"job {job_id}: {submit.overall_state(comps)} ({submit.describe(comps)})")
    if run_dir is not None:
        progress = ProgressPrinter(RunPaths(run_dir), 0)
        try:
            lines = [ln for ln in progress.paths.metrics.read_text().splitlines() if ln.strip()]
        except FileNotFoundError:
            lines = []
        print(f"run dir {run_dir}: {len(lines)} trainer steps logged; batch log {batch_log(run_dir, job_id)}")
    return 0


def cancel(target: Optional[str]) -> int:
    job_id, run_dir = resolve(target)
    submit.cancel(job_id)
    print(f"cancelled job {job_id}" + (f" ({run_dir})" if run_dir else ""))
    return 0


USAGE = "usage: slurmrl status|cancel [RUN_DIR | JOB_ID]   (default: runs/latest)"


def command_line(mode: str, args: list[str]) -> int:
    if len(args) > 1 or (args and args[0].startswith("-")):
        print(USAGE)
        return 2
    try:
        return (status if mode == "status" else cancel)(args[0] if args else None)
    except submit.SubmitError as e:
        print(f"slurmrl {mode}: error: {e}")
        return 1
