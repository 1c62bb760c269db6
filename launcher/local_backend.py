"""Local backend: run a JobPlan as processes on this machine and watch them.

Every child gets its own session (a terminal Ctrl-C reaches only the launcher, which then
stops the children in order) and PR_SET_PDEATHSIG, so even a SIGKILLed launcher leaves
no child behind. Children are stopped only by the PIDs this launcher started: SIGTERM,
``launcher.shutdown_grace_s``, then SIGKILL.

The run ends when the trainer ranks and the orchestrator exit 0 (the plan's main roles); the
servers (and SGLang's router) are then stopped. On a GPU machine each child gets the
CUDA_VISIBLE_DEVICES the plan chose for it (launcher/gpus.py). A process exiting non-zero
(or killed) is started again with the same environment up to ``launcher.max_restarts`` times (the trainer resumes from its checkpoint,
the orchestrator from its ledger, a worker loads the newest weights and the orchestrator
brings it to its version); beyond that (default 2 each; 0 is fail-fast) it stops the whole run and
prints its log tail. A process exiting with ``EXIT_FATAL`` (workers/common/exits.py: a diverged
optimizer, a config error) stops the run at once: a restart would only repeat it. An inference
worker the orchestrator marked dead while its process still runs (hung) is killed by PID after
``launcher.hung_worker_kill_s`` and restarted the same way (launcher/hung.py). Restarts are listed in ``run_dir/restarts.jsonl``.
"""
from __future__ import annotations

import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from launcher.hung import hung_workers
from launcher.plan import JobPlan
from launcher.progress import ProgressPrinter
from workers.common.config import RunConfig
from workers.common.exits import EXIT_FATAL
from workers.common.protocol import USER_ERROR_EXIT, RunPaths
from workers.common.registry import BACKENDS
from workers.common.topology import PORT_MASTER, PORT_ROUTER, PORT_WEIGHTS, server_ports

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


def free_block(host: str, port_min: int, span: int, slots: int) -> int:
    """First port of a block of ``span`` ports all free on ``host`` (slots of cluster.port_min +
    k * port_span, tried from a random one: two local runs rarely try the same block first)."""
    start = random.randrange(slots)
    for k in range(slots):
        base = port_min + ((start + k) % slots) * span
        socks = []
        try:
            for p in range(base, base + span):
                s = socket.socket()
                socks.append(s)
                s.bind((host, p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of cluster.port_span({span}) free ports from cluster.port_min({port_min}) in "
                       f"cluster.num_port_slots({slots}) slots on {host}")


class Child:
    def __init__(self, role: str, rank: int, proc: subprocess.Popen, log: Path, module: str = "",
                 env: Optional[dict] = None):
        self.role, self.rank, self.proc, self.log = role, rank, proc, log
        self.module, self.env, self.restarts = module, env or {}, 0
        self.started = time.time()  # wall time of the running process's start (hung.py compares it)

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
        if BACKENDS.get(self.cfg.inference.backend).uses_gpus:  # SGLang: the Slurm job's port layout
            ports = self.job_ports(host, n_inf)
        else:
            free = self.local_ports(host, n_inf + 1)
            ports = {"SLURMRL_INFERENCE_URLS": ",".join(f"http://{host}:{p}" for p in free[:n_inf]),
                     "MASTER_PORT": str(free[-1])}
        base = {"SLURMRL_RUN_DIR": str(self.paths.root), "SLURMRL_LOCAL": "1", **ports,
                "SLURMRL_BIND_HOST": host, "MASTER_ADDR": "127.0.0.1",
                "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **self.cfg.cluster.env}
        gpus = {(p.role, p.rank): p.cuda_visible_devices for p in self.plan.gpu_placement}
        envs = {}
        for role in self.plan.roles:
            envs[role.role] = [{**base, "SLURMRL_ROLE": role.role, "RANK": str(r), "SLURMRL_RANK": str(r),
                                "WORLD_SIZE": str(role.num_procs)} for r in range(role.num_procs)]
            for r, env in enumerate(envs[role.role]):
                if (role.role, r) in gpus:  # launcher/gpus.py: this process's GPUs (cuda:0.. inside it)
                    env["CUDA_VISIBLE_DEVICES"] = gpus[role.role, r]
        return envs

    def local_ports(self, host: str, n: int) -> list[int]:
        """``n`` ports for the embedded servers and the trainer's MASTER_PORT, from a free block of
        ``cluster.port_span`` at ``cluster.port_min`` (20000: below Linux's ephemeral range, 32768-60999):
        a port the kernel hands out to any socket (a gloo pair, an HTTP client) can be taken between this
        check and the server's bind, and under load it was (a CI run lost a worker to EADDRINUSE).
        More ports than a block holds: the kernel's free ports, as before."""
        c = self.cfg.cluster
        if n > c.port_span:
            return free_ports(n, host)
        base = free_block(host, c.port_min, c.port_span, c.num_port_slots)
        return list(range(base, base + n))

    def job_ports(self, host: str, n_inf: int) -> dict[str, str]:
        """Ports as a Slurm job lays them out (workers/common/topology.py offsets) in one free block of
        ``cluster.port_span``: SGLang derives its extra ports from the server's (sglang/ports.py)."""
        c = self.cfg.cluster
        base = free_block(host, c.port_min, c.port_span, c.num_port_slots)
        out = {"SLURMRL_INFERENCE_URLS": ",".join(f"http://{host}:{server_ports(base, i)[0]}" for i in range(n_inf)),
               "MASTER_PORT": str(base + PORT_MASTER), "SLURMRL_WEIGHTS_GROUP_ADDR": f"{host}:{base + PORT_WEIGHTS}"}
        if any(r.role == "router" for r in self.plan.roles):
            out["SLURMRL_ROUTER_URL"] = f"http://{host}:{base + PORT_ROUTER}"
        return out

    @property
    def main_roles(self) -> set[str]:
        """The roles whose exit 0 ends the run (trainer, orchestrator); servers and a router are then stopped."""
        return {r.role for r in self.plan.roles if r.main}

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
        c.started = time.time()
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

    def kill_hung(self) -> None:
        """SIGKILL (by PID) each inference worker the orchestrator marked dead over
        ``launcher.hung_worker_kill_s`` ago while its process still runs (launcher/hung.py); the
        next turn of the watch loop restarts it like any killed child."""
        workers = {c.rank: c for c in self.children if c.role == "inference" and c.proc.poll() is None}
        hung = hung_workers(self.paths.root, {w: c.started for w, c in workers.items()},
                            kill_after_s=self.cfg.launcher.hung_worker_kill_s)
        for w, dead_s in hung.items():
            c = workers[w]
            print(f"[slurmrl] {c.name} (pid {c.proc.pid}) was marked dead {dead_s:.0f}s ago but still runs (hung): "
                  f"killing it (launcher.hung_worker_kill_s={self.cfg.launcher.hung_worker_kill_s:g})", flush=True)
            c.proc.kill()
            c.proc.wait()

    def _on_signal(self, signum, _frame) -> None:
        self.stop_requested = signal.Signals(signum).name

    def run(self) -> int:
        """Start, watch, stop. Returns the exit code for the launcher."""
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        progress = ProgressPrinter(self.paths, self.cfg.trainer.num_steps, started=time.time(),
                                   resumed=bool(self.cfg.launcher.resume))
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
                self.kill_hung()
                failed = [c for c in self.children if c.proc.poll() not in (None, 0)]
                for c in [c for c in failed if c.restarts < self.cfg.launcher.max_restarts
                          and c.proc.returncode not in (USER_ERROR_EXIT, EXIT_FATAL)]:  # a restart repeats it
                    self.restart(c)
                    failed.remove(c)
                if failed:
                    c = failed[0]
                    said = user_error(c.log) if c.proc.returncode == USER_ERROR_EXIT else None
                    why = (" (a deterministic failure: a diverged run, a config error or the user's reward; not "
                           "restarted)" if c.proc.returncode == EXIT_FATAL else "")
                    print(f"[slurmrl] {c.name} exited with code {c.proc.returncode}{why}; stopping the run. " +
                          (said or f"Last lines of {c.log}:\n{tail(c.log)}"), flush=True)
                    code = 1
                    break
                if all(c.proc.poll() == 0 for c in self.children if c.role in self.main_roles):
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


def user_error(path: Path) -> str | None:
    """The ``slurmrl: error:`` line a role wrote before exiting with USER_ERROR_EXIT (the one cause)."""
    lines = [ln for ln in tail(path, 200).splitlines() if ln.startswith("slurmrl: error:")]
    return f"{lines[-1]} (log: {path})" if lines else None


def tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as e:
        return f"(cannot read {path}: {e})"
