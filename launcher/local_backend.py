"""Local backend: run a JobPlan as processes on this machine and watch them.

Every child gets its own session (a terminal Ctrl-C reaches only the launcher, which then
stops the children in order) and PR_SET_PDEATHSIG, so even a SIGKILLed launcher leaves
no child behind. Children are stopped only by the PIDs this launcher started: SIGTERM,
``launcher.shutdown_grace_s``, then SIGKILL.

The run ends when the trainer ranks and the orchestrator exit 0; inference workers are
then stopped. A process exiting non-zero (or killed) is started again with the same
environment up to ``launcher.max_restarts`` times (the trainer resumes from its checkpoint,
the orchestrator from its ledger, a worker loads the newest weights and the orchestrator
brings it to its version); beyond that (default 2 each; 0 is fail-fast) it stops the whole run and
prints its log tail. Restarts are listed in ``run_dir/restarts.jsonl``.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from launcher.plan import JobPlan
from launcher.progress import ProgressPrinter
from workers.common.config import RunConfig
from workers.common.protocol import RunPaths

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not glibc: the launcher's own cleanup still applies
        pass


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Child:
    def __init__(self, role: str, rank: int, proc: subprocess.Popen, log: Path, module: str = "",
                 env: Optional[dict] = None):
        self.role, self.rank, self.proc, self.log = role, rank, proc, log
        self.module, self.env, self.restarts = module, env or {}, 0

    @property
    def name(self) -> str:
        return f"{self.role}[{self.rank}]"


class LocalBackend:
    def __init__(self, cfg: RunConfig, plan: JobPlan, paths: RunPaths):
        self.cfg, self.plan, self.paths = cfg, plan, paths
        self.children: list[Child] = []
        self.stop_requested: Optional[str] = None
        self.progress_summary = "no steps recorded"

    def role_envs(self) -> dict[str, list[dict[str, str]]]:
        host = self.cfg.inference.host
        n_inf = self.plan.role("inference").num_procs
        ports = free_ports(n_inf + 1, host)
        urls = ",".join(f"http://{host}:{p}" for p in ports[:n_inf])
        base = {"SLURMRL_RUN_DIR": str(self.paths.root), "SLURMRL_LOCAL": "1", "SLURMRL_INFERENCE_URLS": urls,
                "SLURMRL_BIND_HOST": host, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(ports[-1]),
                "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **self.cfg.cluster.env}
        envs = {}
        for role in self.plan.roles:
            envs[role.role] = [{**base, "SLURMRL_ROLE": role.role, "RANK": str(r), "SLURMRL_RANK": str(r),
                                "WORLD_SIZE": str(role.num_procs)} for r in range(role.num_procs)]
        return envs

    def start(self) -> None:
        envs = self.role_envs()
        for role in self.plan.roles:  # trainer first: rank 0 publishes the step-0 weights
            for rank, extra in enumerate(envs[role.role]):
                log = self.paths.logs_dir / f"{role.role}_{rank}.log"
                child = Child(role.role, rank, None, log, role.module, extra)  # type: ignore[arg-type]
                child.proc = self.spawn(child)
                self.children.append(child)
        self.write_pids()

    def spawn(self, c: Child) -> subprocess.Popen:
        """Start (or restart) one child; its log is appended to, never truncated."""
        with open(c.log, "ab") as fh:
            return subprocess.Popen([sys.executable, "-m", c.module], env={**os.environ, **c.env},
                                    stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    preexec_fn=_die_with_parent, cwd=os.getcwd())

    def write_pids(self) -> None:
        pids = {c.name: c.proc.pid for c in self.children}
        (self.paths.root / "pids.json").write_text(json.dumps({"launcher": os.getpid(), "children": pids}, indent=1))

    def restart(self, c: Child) -> None:
        """Supervised restart of a child that exited non-zero (``launcher.max_restarts``)."""
        code = c.proc.returncode
        c.restarts += 1
        print(f"[slurmrl] {c.name} exited with code {code}; restart {c.restarts}/{self.cfg.launcher.max_restarts}",
              flush=True)
        c.proc = self.spawn(c)
        with open(self.paths.root / "restarts.jsonl", "a") as fh:
            fh.write(json.dumps({"time": time.time(), "child": c.name, "exit_code": code, "restart": c.restarts,
                                 "pid": c.proc.pid}) + "\n")
        self.write_pids()

    def _on_signal(self, signum, _frame) -> None:
        self.stop_requested = signal.Signals(signum).name

    def run(self) -> int:
        """Start, watch, stop. Returns the exit code for the launcher."""
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        progress = ProgressPrinter(self.paths, self.cfg.trainer.num_steps)
        code = 0
        try:
            self.start()
            print(f"[slurmrl] started {len(self.children)} processes; logs in {self.paths.logs_dir}", flush=True)
            while True:
                progress.poll()
                if self.stop_requested:
                    print(f"\n[slurmrl] {self.stop_requested}: stopping all roles", flush=True)
                    code = 130
                    break
                failed = [c for c in self.children if c.proc.poll() not in (None, 0)]
                for c in [c for c in failed if c.restarts < self.cfg.launcher.max_restarts]:
                    self.restart(c)
                    failed.remove(c)
                if failed:
                    c = failed[0]
                    print(f"[slurmrl] {c.name} exited with code {c.proc.returncode}; stopping the run. "
                          f"Last lines of {c.log}:\n{tail(c.log)}", flush=True)
                    code = 1
                    break
                if all(c.proc.poll() == 0 for c in self.children if c.role != "inference"):
                    progress.poll()
                    break
                time.sleep(0.2)
        finally:
            self.stop_all()
            progress.poll()
            self.progress_summary = progress.summary()
            for s, h in old.items():
                signal.signal(s, h)
        return code

    def stop_all(self) -> None:
        """SIGTERM every live child (inference last), wait the grace period, SIGKILL the rest."""
        live = [c for c in self.children if c.proc.poll() is None]
        for c in sorted(live, key=lambda c: c.role == "inference"):
            try:
                c.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + self.cfg.launcher.shutdown_grace_s
        for c in live:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"[slurmrl] {c.name} (pid {c.proc.pid}) ignored SIGTERM; killing it", flush=True)
                c.proc.kill()
                c.proc.wait()


def tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as e:
        return f"(cannot read {path}: {e})"
