"""Supervision of a slurmrl hetjob's srun steps, run inside the allocation by the batch script.

The rendered script (sbatch_templates/hetjob.sbatch.j2) writes its steps, one ``srun
--het-group=K`` command line each, to a steps file and then ``exec``s this module, so the
templates stay plain text an admin can read and edit while the bookkeeping lives here, in
tested Python (it was a 125-line bash function among the templates). Standard library
only: it runs on the batch node with the run's Python, never imports torch.

Steps file: one step per line (``\\``-continued lines are joined, ``#`` comments ignored)::

    slurmrl_step NAME main=0|1 het_group=K respawn=0|1 -- ARGV...

Rules (every wait has a deadline):
- Every step is started at once, as a child process (srun) of this one.
- A step exiting 0 is done. When every ``main`` step (trainer, orchestrator) is done, the
  servers are stopped and the job exits 0.
- A step exiting non-zero (a role crashed, a task was SIGKILLed, ``scancel JOB.STEP``):
  a ``respawn=1`` step (an inference server) is started again -- the same srun line, so a
  new step on the same het group's nodes -- after ``backoff_s * 2**k`` (capped at
  ``backoff_max_s``), at most ``max_respawns`` times per step (cluster.server_respawns);
  each respawn is appended to ``run_dir/restarts.jsonl`` like the local backend's restarts.
  A step exiting ``EXIT_FATAL`` (workers/common/exits.py: divergence, a config error) is never
  respawned: the job stops with its reason. A server step with a worker the orchestrator marked
  dead beyond ``launcher.hung_worker_kill_s`` while the step still runs (hung) is killed
  (``scancel --signal=KILL`` on the step) and so respawned (launcher/hung.py).
  The orchestrator re-admits the new server (workers/orchestrator/faults.py). Any other
  failure, or one past the respawn budget, stops every step and exits 1.
- Stopping: ``scancel --signal=TERM`` per component with live steps (the leader's id once
  when group 0 is among them: it reaches every component), so tasks that exit 0 on SIGTERM
  end COMPLETED; after ``shutdown_grace_s`` the srun processes get SIGTERM.
- SIGUSR1 (``--signal=B:USR1@N``: time limit or preemption) stops the steps and, while
  ``SLURM_RESTART_COUNT < max_requeues``, runs ``scontrol requeue``; exit 143.
  SIGTERM/SIGINT stop the steps, exit 143.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence

from launcher.hung import hung_workers
from workers.common.exits import EXIT_FATAL

USER_ERROR_EXIT = EXIT_FATAL  # workers.common.protocol.USER_ERROR_EXIT: the same sysexits EX_CONFIG (78)

POLL_S = 1.0
STEP_KEYWORD = "slurmrl_step"


def log(message: str) -> None:
    print(f"[slurmrl {time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclasses.dataclass
class Step:
    """One srun step: its name (the role), whether the job waits for it, its het group, its argv."""

    name: str
    main: bool
    het_group: int
    respawn: bool
    argv: list[str]
    proc: Optional[subprocess.Popen] = None
    started: float = 0.0  # wall time of the running srun's start (launcher/hung.py compares it)
    respawns: int = 0
    restart_at: Optional[float] = None  # monotonic time of a scheduled respawn
    done: bool = False

    @property
    def live(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def parse_steps(text: str) -> list[Step]:
    """The steps file (module docstring) -> Steps; ValueError naming the line for anything else."""
    steps, lines, cont = [], [], ""
    for raw in text.splitlines():
        if not cont and raw.lstrip().startswith("#"):
            continue  # a comment line, even one ending in "\\" (the SGLang command previews)
        if raw.endswith("\\"):
            cont += raw[:-1] + " "
            continue
        lines.append(cont + raw)
        cont = ""
    for line in lines + ([cont] if cont else []):
        tokens = shlex.split(line, comments=True)
        if not tokens:
            continue
        if tokens[0] != STEP_KEYWORD or "--" not in tokens or len(tokens) < 3:
            raise ValueError(f"steps file: expected '{STEP_KEYWORD} NAME key=value... -- ARGV', got {line.strip()[:200]!r}")
        cut = tokens.index("--")
        opts = dict(t.split("=", 1) for t in tokens[2:cut] if "=" in t)
        unknown = sorted(set(opts) - {"main", "het_group", "respawn"})
        if unknown or not tokens[cut + 1:]:
            raise ValueError(f"steps file: step {tokens[1]!r} has unknown options {unknown} or no command")
        steps.append(Step(name=tokens[1], main=opts.get("main") == "1", het_group=int(opts.get("het_group", 0)),
                          respawn=opts.get("respawn") == "1", argv=tokens[cut + 1:]))
    return steps


def backoff(k: int, base_s: float, max_s: float) -> float:
    """Seconds before respawn number ``k`` (0-based): base * 2^k, at most max_s."""
    return min(base_s * (2 ** k), max_s)


def component_ids(groups: Sequence[int], env: Mapping[str, str]) -> list[str]:
    """Job ids to ``scancel --signal`` so every listed het group's tasks get it: the leader's id
    alone when group 0 is among them (it reaches every component), else each group's own id."""
    leader = env.get("SLURM_JOB_ID", "")
    ids = [env.get(f"SLURM_JOB_ID_HET_GROUP_{g}", leader) for g in sorted(set(groups))]
    if leader in ids:
        return [leader]
    return list(dict.fromkeys(ids))


class Supervisor:
    def __init__(self, steps: list[Step], *, log_dir: Path, run_dir: Path, shutdown_grace_s: float,
                 signal_grace_s: int, max_requeues: int, max_respawns: int, backoff_s: float, backoff_max_s: float,
                 env: Mapping[str, str]):
        self.steps, self.log_dir, self.run_dir, self.env = steps, log_dir, run_dir, env
        self.shutdown_grace_s, self.signal_grace_s, self.max_requeues = shutdown_grace_s, signal_grace_s, max_requeues
        self.max_respawns, self.backoff_s, self.backoff_max_s = max_respawns, backoff_s, backoff_max_s
        self.signal: Optional[int] = None

    def start(self, step: Step) -> None:
        step.started = time.time()
        step.proc = subprocess.Popen(step.argv, stdin=subprocess.DEVNULL)
        step.restart_at = None
        log(f"started {step.name} (het group {step.het_group}, srun pid {step.proc.pid})")

    def tail(self, name: str, n: int = 20) -> None:
        path = self.log_dir / f"{name}_0.log"
        if path.is_file():
            log(f"last lines of {path} (all ranks: {self.log_dir}/{name}_*.log):")
            print("\n".join(path.read_text(errors="replace").splitlines()[-n:]), flush=True)

    def on_exit(self, step: Step, rc: int) -> Optional[str]:
        """A step's srun ended with ``rc``: mark it done, schedule a respawn, or say why the job fails."""
        if rc == 0:
            step.done = True
            log(f"{step.name} finished")
            return None
        log(f"{step.name} exited with status {rc}")
        self.tail(step.name)
        if rc in (EXIT_FATAL, USER_ERROR_EXIT):
            log(f"{step.name}: a deterministic failure (a diverged run, a config error or the user's reward): "
                f"not restarted")
            return f"{step.name} exited with status {rc}"
        if not (step.respawn and step.respawns < self.max_respawns):
            return f"{step.name} exited with status {rc}"
        wait = backoff(step.respawns, self.backoff_s, self.backoff_max_s)
        step.respawns += 1
        step.restart_at = time.monotonic() + wait
        log(f"respawning {step.name} as a new step on het group {step.het_group} in {wait:.0f}s "
            f"(respawn {step.respawns}/{self.max_respawns})")
        with open(self.run_dir / "restarts.jsonl", "a") as fh:
            fh.write(json.dumps({"time": time.time(), "child": step.name, "exit_code": rc, "restart": step.respawns,
                                 "het_group": step.het_group, "backoff_s": wait, "backend": "slurm"}) + "\n")
        return None

    def kill_hung(self) -> None:
        """A server step one of whose workers the orchestrator marked dead over its kill bound ago
        while the step still runs (launcher/hung.py: hung, not exited) is killed; its exit then
        respawns it like any failed server step."""
        for step in self.steps:
            if step.respawn and step.live:
                hung = hung_workers(self.run_dir, step.started)
                if hung:
                    w, dead_s = next(iter(hung.items()))
                    log(f"{step.name}: worker {w} was marked dead {dead_s:.0f}s ago but its step still runs (hung): "
                        f"killing the step")
                    self.kill_step(step)

    def kill_step(self, step: Step) -> None:
        """SIGKILL every task of ``step``: ``scancel --signal=KILL`` on its Slurm step (found by name in
        its het component), else the srun process itself."""
        job = self.env.get(f"SLURM_JOB_ID_HET_GROUP_{step.het_group}", self.env.get("SLURM_JOB_ID", ""))
        try:
            out = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i %j"], capture_output=True, text=True,
                                 timeout=30, check=True).stdout if job else ""
            ids = [line.split()[0] for line in out.splitlines() if line.split()[1:] == [step.name]]
            if ids:
                subprocess.run(["scancel", "--signal=KILL", ids[-1]], capture_output=True, timeout=30, check=True)
                return
        except (OSError, subprocess.SubprocessError) as e:
            log(f"cannot scancel {step.name}'s step ({e}); killing its srun")
        step.proc.kill()

    def run(self) -> int:
        """Start every step, watch them; the job's exit status (module docstring)."""
        for step in self.steps:
            self.start(step)
        while True:
            if self.signal is not None:
                return self.on_signal()
            self.kill_hung()
            failure = None
            for step in self.steps:
                if step.restart_at is not None and time.monotonic() >= step.restart_at:
                    self.start(step)
                if step.proc is None or step.done or step.restart_at is not None or step.live:
                    continue
                failure = failure or self.on_exit(step, step.proc.returncode)
            if failure:
                log("a role failed: stopping the whole job")
                return 1
            if all(s.done for s in self.steps if s.main):
                log("trainer and orchestrator finished: stopping the servers")
                return 0
            time.sleep(POLL_S)

    def on_signal(self) -> int:
        if self.signal == signal.SIGUSR1:
            log(f"USR1: time limit or preemption in {self.signal_grace_s} s")
            restarts = int(self.env.get("SLURM_RESTART_COUNT", "0") or 0)
            if restarts < self.max_requeues:
                self.stop_steps()
                job = self.env.get("SLURM_JOB_ID", "")
                log(f"requeueing job {job} (restart {restarts}, at most {self.max_requeues})")
                subprocess.run(["scontrol", "requeue", job], check=False, timeout=60)
        else:
            log("SIGTERM/SIGINT: stopping all roles")
        return 143

    def stop_steps(self) -> None:
        """SIGTERM every live step through Slurm, wait the grace period, then end the srun processes."""
        for s in self.steps:
            s.restart_at = None  # a pending respawn is not started any more
        live = [s for s in self.steps if s.live]
        if not live:
            return
        ids = component_ids([s.het_group for s in live], self.env)
        log(f"stopping {' '.join(s.name for s in live)} (scancel --signal=TERM {' '.join(ids)})")
        for job in ids:
            try:
                subprocess.run(["scancel", "--signal=TERM", job], capture_output=True, check=False, timeout=60)
            except (OSError, subprocess.TimeoutExpired) as e:  # the srun processes still get SIGTERM below
                log(f"scancel --signal=TERM {job} failed: {e}")
        deadline = time.monotonic() + self.shutdown_grace_s
        while any(s.live for s in live) and time.monotonic() < deadline:
            time.sleep(0.5)
        for s in live:
            if s.live:
                log(f"{s.name} still runs after {self.shutdown_grace_s:g} s: ending its srun")
                s.proc.terminate()
        for s in live:
            try:
                rc = s.proc.wait(timeout=max(self.shutdown_grace_s, 10))
            except subprocess.TimeoutExpired:
                s.proc.kill()
                rc = s.proc.wait()
            log(f"{s.name} exited with status {rc} (stopped)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launcher.supervisor", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", required=True, type=Path, help="the steps file the batch script wrote")
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--log-dir", required=True, type=Path)
    p.add_argument("--shutdown-grace-s", type=float, default=10.0)
    p.add_argument("--signal-grace-s", type=int, default=120)
    p.add_argument("--max-requeues", type=int, default=0, help="0: never requeue on USR1")
    p.add_argument("--max-respawns", type=int, default=0, help="per respawn=1 step (cluster.server_respawns)")
    p.add_argument("--backoff-s", type=float, default=5.0)
    p.add_argument("--backoff-max-s", type=float, default=60.0)
    a = p.parse_args(argv)
    sup = Supervisor(parse_steps(a.steps.read_text()), log_dir=a.log_dir, run_dir=a.run_dir,
                     shutdown_grace_s=a.shutdown_grace_s, signal_grace_s=a.signal_grace_s, max_requeues=a.max_requeues,
                     max_respawns=a.max_respawns, backoff_s=a.backoff_s, backoff_max_s=a.backoff_max_s,
                     env=dict(os.environ))  # the batch step's own SLURM_* (job ids, restart count)

    def on_signal(signum, _frame):
        sup.signal = signum
    for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    code = 1
    try:
        code = sup.run()
    finally:
        sup.stop_steps()
    return code


if __name__ == "__main__":
    sys.exit(main())
