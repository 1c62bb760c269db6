"""Talk to Slurm through its commands: sbatch --parsable, scontrol, sacct, scancel.

Also following a submitted job (per-step progress lines from run_dir/metrics.jsonl, as the
local backend prints them, plus one line per job-state change; Ctrl-C stops following, never
the job) and the ``slurmrl status|cancel [RUN_DIR|JOB_ID]`` commands.

pyslurm does not match Slurm 22.05 (docs/design.md, "Platform facts"), and the commands are what an admin
would type anyway. Job ids: ``sbatch --parsable`` prints the leader id L (or ``L;cluster``);
het components are the jobs L, L+1, ... that ``scontrol show job L`` lists one record each
(HetJobOffset 0, 1, ...) and sacct shows as ``L+K``. scontrol works without accounting but
forgets a job MinJobAge seconds after it ended; sacct (slurmdbd) then still knows it.
The job id is recorded in ``run_dir/slurm/job_id`` so status/cancel can start from a run dir.
"""
from __future__ import annotations

import dataclasses
import signal
import sys
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional

from launcher.local_backend import tail
from launcher.progress import ProgressPrinter
from workers.common.protocol import RunPaths

ACTIVE = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
                    "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "PREEMPTED"})
COMMAND_TIMEOUT_S = 60.0


class SubmitError(RuntimeError):
    """A Slurm command failed; the message carries its stderr."""


def run(cmd: list[str], *, timeout_s: float = COMMAND_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError as e:
        raise SubmitError(f"{cmd[0]} not found: is this a Slurm login node? ({e})") from e
    except subprocess.TimeoutExpired as e:
        raise SubmitError(f"{' '.join(cmd)} did not answer within {timeout_s:.0f}s: is slurmctld up?") from e
    if check and res.returncode != 0:
        raise SubmitError(f"{' '.join(cmd)} failed ({res.returncode}): {(res.stderr or res.stdout).strip()}")
    return res


def submit(script: Path) -> str:
    """``sbatch --parsable SCRIPT`` -> the leader's job id."""
    out = run(["sbatch", "--parsable", str(script)]).stdout.strip()
    job_id = out.split(";")[0]
    if not job_id.isdigit():
        raise SubmitError(f"sbatch --parsable printed {out!r}, not a job id")
    return job_id


def job_id_file(run_dir: Path) -> Path:
    return Path(run_dir) / "slurm" / "job_id"


def record_job_id(run_dir: Path, job_id: str) -> None:
    path = job_id_file(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(".job_id.tmp")
    tmp.write_text(job_id + "\n")
    tmp.replace(path)


def read_job_id(run_dir: Path) -> str:
    path = job_id_file(run_dir)
    if not Path(run_dir).is_dir():
        raise SubmitError(f"{run_dir} is not a run directory (give RUN_DIR or a Slurm JOB_ID)")
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        raise SubmitError(f"{path} does not exist: {run_dir} was not submitted to Slurm (a local or dry run?)") from None
    except (OSError, ValueError) as e:
        raise SubmitError(f"{path} cannot be read: {e}") from None


@dataclasses.dataclass(frozen=True)
class Component:
    """One het component as Slurm reports it."""

    job_id: str
    """The component's own id (L+K as a number) or sacct's ``L+K``."""
    offset: int
    state: str
    nodes: str
    exit_code: str


def scontrol_components(job_id: str) -> Optional[list[Component]]:
    """Components from ``scontrol show job -o``, or None when slurmctld forgot the job."""
    res = run(["scontrol", "show", "job", "-o", job_id], check=False)
    if res.returncode != 0:
        if "Invalid job id" in res.stderr:
            return None
        raise SubmitError(f"scontrol show job {job_id} failed: {res.stderr.strip()}")
    comps = []
    for line in res.stdout.splitlines():
        rec = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "JobId" in rec:
            comps.append(Component(job_id=rec["JobId"], offset=int(rec.get("HetJobOffset", 0)),
                                   state=rec.get("JobState", "UNKNOWN"), nodes=rec.get("NodeList", ""),
                                   exit_code=rec.get("ExitCode", "")))
    return sorted(comps, key=lambda c: c.offset)


def sacct_rows(job_id: str) -> dict[str, str]:
    """``JobID -> State`` for the job, its components (L+K) and steps (L+K.S)."""
    res = run(["sacct", "-j", job_id, "--format=JobID,State", "-P", "-n"])
    rows = {}
    for line in res.stdout.splitlines():
        if "|" in line:
            jid, state = line.split("|", 1)
            rows[jid] = state.split()[0]  # "CANCELLED by 0" -> CANCELLED
    return rows


def components(job_id: str) -> list[Component]:
    comps = scontrol_components(job_id)
    if comps is not None:
        return comps
    rows = sacct_rows(job_id)
    parts = sorted((k for k in rows if "." not in k and "+" in k), key=lambda k: int(k.split("+")[1]))
    if not parts and job_id in rows:
        parts = [job_id]
    if not parts:
        raise SubmitError(f"job {job_id} is unknown to scontrol and sacct")
    return [Component(job_id=p, offset=int(p.split("+")[1]) if "+" in p else 0, state=rows[p], nodes="", exit_code="")
            for p in parts]


def overall_state(comps: list[Component]) -> str:
    """RUNNING/PENDING/... while any component is active, COMPLETED if all are, else the first failure."""
    states = [c.state for c in comps]
    for s in ("RUNNING", "COMPLETING", "CONFIGURING", "PENDING", "REQUEUED", "SUSPENDED"):
        if s in states:
            return s
    active = [s for s in states if s in ACTIVE]
    if active:
        return active[0]
    bad = [s for s in states if s != "COMPLETED"]
    return bad[0] if bad else "COMPLETED"


def cancel(job_id: str) -> None:
    run(["scancel", job_id])


def wait_until_done(job_id: str, *, timeout_s: float, poll_s: float = 1.0,
                    on_poll: Optional[Callable[[list[Component]], None]] = None) -> list[Component]:
    """Poll until no component is active; raise SubmitError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        comps = components(job_id)
        if on_poll:
            on_poll(comps)
        if not any(c.state in ACTIVE for c in comps):
            return comps
        if time.monotonic() > deadline:
            raise SubmitError(f"job {job_id} still {overall_state(comps)} after {timeout_s:.0f}s")
        time.sleep(poll_s)


def describe(comps: list[Component]) -> str:
    return ", ".join(f"+{c.offset} {c.state}" + (f" on {c.nodes}" if c.nodes and c.nodes != "(null)" else "")
                     for c in comps)


POLL_S = 2.0


def batch_log(run_dir: Path, job_id: str) -> Path:
    return Path(run_dir) / "logs" / f"slurm-{job_id}.out"


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
            comps = components(job_id)
            now = describe(comps)
            if now != last:
                print(f"[slurmrl] job {job_id}: {now}", flush=True)
                last = now
            progress.poll()
            if not any(c.state in ACTIVE for c in comps):
                break
            time.sleep(poll_s)
    except _Interrupted:
        print(f"\n[slurmrl] stopped following; job {job_id} keeps running. "
              f"`slurmrl status {paths.root}` or `slurmrl cancel {paths.root}`", flush=True)
        return 130
    finally:
        signal.signal(signal.SIGINT, old)
    progress.poll()
    state = overall_state(comps)
    print(f"[slurmrl] job {job_id} ended {state}: {progress.summary()}", flush=True)
    from launcher.run_status import next_commands

    for line in next_commands(paths.root, finished=state == "COMPLETED"):
        print(f"[slurmrl]   {line}", flush=True)
    if state != "COMPLETED":
        log = batch_log(paths.root, job_id)
        print(f"[slurmrl] last lines of {log}:\n{tail(log, 30)}", flush=True)
        return 1
    return 0


def resolve(target: Optional[str]) -> tuple[str, Optional[Path]]:
    """A job id, a run dir (with slurm/job_id) or, by default, runs/latest -> (job id, run dir)."""
    if target and target.isdigit():
        return target, None
    run_dir = Path(target or "runs/latest").expanduser().resolve()
    return read_job_id(run_dir), run_dir


def status_command(target: Optional[str]) -> int:
    if not (target and target.isdigit()):  # a local or dry run: its directory says everything
        root = Path(target or "runs/latest").expanduser().resolve()
        if (root / "config" / "run.yaml").exists() and not job_id_file(root).exists():
            from launcher.run_status import describe_local

            print("\n".join(describe_local(root)))
            return 0
    job_id, run_dir = resolve(target)
    comps = components(job_id)
    print(f"job {job_id}: {overall_state(comps)} ({describe(comps)})")
    if run_dir is not None:
        from launcher.run_status import records, trained

        steps = len(trained(records(RunPaths(run_dir))))
        print(f"run dir {run_dir}: {steps} trainer steps logged; batch log {batch_log(run_dir, job_id)}")
        from launcher.timeline import summary_line

        if (line := summary_line(run_dir)) is not None:
            print(line)
    return 0


def cancel_command(target: Optional[str]) -> int:
    job_id, run_dir = resolve(target)
    cancel(job_id)
    print(f"cancelled job {job_id}" + (f" ({run_dir})" if run_dir else ""))
    return 0


USAGE = ("usage: slurmrl status|cancel [RUN_DIR | JOB_ID]   (default: runs/latest; status reads a local or dry "
         "run from its directory)\n"
         "       slurmrl status --all [RUNS_ROOT]           (every run: state, step, last reward, pending reason)")


def command_line(mode: str, args: list[str]) -> int:
    if any(a in ("--help", "-h") for a in args):
        print(USAGE)
        return 0
    if len(args) > 1 or (args and args[0].startswith("-")):
        print(USAGE, file=sys.stderr)
        return 2
    try:
        return (status_command if mode == "status" else cancel_command)(args[0] if args else None)
    except SubmitError as e:
        print(f"slurmrl {mode}: error: {e}")
        return 1
