"""Chaos benchmark: a local run that keeps training while its processes are killed.

    python -m benchmarks.chaos [--steps 30] [--out benchmarks/results/chaos.json] [overrides...]

Starts the real ``slurmrl`` local run (launcher.max_restarts > 0, so the launcher respawns
what dies), then, as the trainer reaches given steps, kills: an inference worker several
times (SIGKILL), the trainer once (SIGTERM by default = preemption: it checkpoints and
exits; ``--trainer-signal KILL`` for a crash, which redoes the steps after the last
periodic checkpoint), and the orchestrator once (SIGKILL). Targets are found by PID in
``run_dir/pids.json`` (the launcher rewrites it on every restart), never by name.

An inference worker is killed while it serves: once its ``/server_info`` reports at least
``BUSY_MIN_RUNNING`` requests running or queued (its URL is the process's own SLURMRL_INFERENCE_URLS
entry), else after ``BUSY_WAIT_S`` anyway (the kill record says ``busy``); a child killed before
is killed again only once the launcher restarted it (a new pid in pids.json). A kill at a
random instant can find every group of the worker past its last generation (in its env
step, which needs no worker): those groups rightly finish, nothing is resubmitted, and the
kill measures nothing. Polling the step count is no substitute: steps say nothing of what the
worker is doing.

Measured from the run's own records, not from this script's guesses:
- ``rollouts_lost``: samples of groups the finished run left pending (ledger.py),
- ``rollouts_trained_twice``: samples of groups that two batches hold (ledger.py),
- ``steps_lost``: trainer steps redone after a resume (checkpoints/resumes.jsonl),
- ``recovery_s``: kill -> the victim is useful again (worker: the orchestrator revived it at
  the current weights; trainer: the restarted process's first step record; orchestrator: the
  restarted process's first batch), median and max,
- ``reward_final``: mean reward of the last 5 steps; metrics.jsonl must hold each step once.
Prints a table and writes JSON. Tests reuse :func:`run_chaos` with smaller schedules.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional

from workers.orchestrator.ledger import read_ledger

REPO = Path(__file__).resolve().parents[1]
FAST = ["orchestrator.num_prompts_per_step=8", "orchestrator.num_samples_per_prompt=4",
        "orchestrator.max_inflight_rollouts=32", "orchestrator.health_check_interval_s=1.0",
        "trainer.checkpoint_every_steps=5", "launcher.max_restarts=10", "launcher.shutdown_grace_s=5"]


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _steps_done(run_dir: Path) -> int:
    recs = _read_jsonl(run_dir / "metrics.jsonl")
    return max((r["step"] for r in recs), default=0)  # 1-based steps: the last is the count


def _pid(run_dir: Path, child: str) -> Optional[int]:
    try:
        return json.loads((run_dir / "pids.json").read_text())["children"].get(child)
    except (OSError, ValueError):
        return None


BUSY_MIN_RUNNING, BUSY_WAIT_S = 2, 30.0


def _server_url(pid: int) -> Optional[str]:
    """The URL inference process ``pid`` serves on: its entry of the launcher-given
    SLURMRL_INFERENCE_URLS at its RANK (Linux /proc; None when the process is gone)."""
    try:
        env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
        return env["SLURMRL_INFERENCE_URLS"].split(",")[int(env["RANK"])]
    except (OSError, KeyError, IndexError, ValueError):
        return None


def _running(url: str, token: str) -> int:
    """Requests the server holds now, running or queued (its /server_info); 0 when it does not answer."""
    req = urllib.request.Request(f"{url}/server_info", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=1.0) as resp:
            info = json.loads(resp.read())
        return int(info.get("num_running_reqs") or 0) + int(info.get("num_waiting_reqs") or 0)
    except (OSError, ValueError):
        return 0


def busy(run_dir: Path, pid: int) -> bool:
    """Inference process ``pid`` holds at least ``BUSY_MIN_RUNNING`` requests right now."""
    url, token_file = _server_url(pid), run_dir / "admin_token"
    if url is None or not token_file.exists():
        return False
    return _running(url, token_file.read_text().strip()) >= BUSY_MIN_RUNNING


def run_chaos(run_dir: Path, *, num_steps: int, schedule: list[tuple[int, str, str]], overrides: list[str] = (),
              timeout_s: float = 600.0) -> dict:
    """Run with kills: ``schedule`` = [(after_step, child name like 'inference[0]', 'KILL'|'TERM')]."""
    run_dir = Path(run_dir)
    cmd = [sys.executable, "-m", "launcher", f"launcher.run_dir={run_dir}", f"trainer.num_steps={num_steps}",
           *FAST, *overrides]
    log = open(run_dir.parent / f"{run_dir.name}.launcher.log", "w")
    t_start = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    kills, pending = [], sorted(schedule)
    killed: set[int] = set()  # a pid stays in pids.json until the launcher restarted its child
    due_since: Optional[float] = None
    try:
        while proc.poll() is None:
            if time.time() - t_start > timeout_s:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=60)
                raise TimeoutError(f"chaos run not done after {timeout_s:.0f}s; see {log.name}")
            if not pending or _steps_done(run_dir) < pending[0][0]:
                time.sleep(0.2)
                continue
            at, child, sig = pending[0]
            due_since = due_since or time.monotonic()
            pid = _pid(run_dir, child)
            if pid is None or pid in killed:  # not (re)started yet
                time.sleep(0.05)
                continue
            is_busy = busy(run_dir, pid) if child.startswith("inference[") else None
            if is_busy is False and time.monotonic() - due_since < BUSY_WAIT_S:
                time.sleep(0.05)  # an inference worker with nothing to lose yet
                continue
            pending.pop(0)
            due_since = None
            try:
                os.kill(pid, getattr(signal, f"SIG{sig}"))
                killed.add(pid)
                kills.append({"child": child, "signal": sig, "after_step": at, "time": time.time(), "busy": is_busy})
            except ProcessLookupError:
                pass
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    report = measure(run_dir, kills, num_steps)
    report["launcher_exit"] = proc.returncode
    report["wall_s"] = round(time.time() - t_start, 1)
    return report


def measure(run_dir: Path, kills: list[dict], num_steps: int) -> dict:
    cfg_samples = _group_size(run_dir)
    led = read_ledger(run_dir / "orchestrator_ledger.jsonl")
    events = _read_jsonl(run_dir / "orchestrator_ledger.jsonl")
    metrics = _read_jsonl(run_dir / "metrics.jsonl")
    resumes = _read_jsonl(run_dir / "checkpoints" / "resumes.jsonl")
    finished = (run_dir / "TRAINER_DONE").exists()
    recovery = []
    restarts = _read_jsonl(run_dir / "restarts.jsonl")
    for k in kills:
        t, who = k["time"], k["child"]
        # the victim's replacement process: anything it does is after this (a SIGTERMed trainer
        # still finishes and records its step before it exits; that is not a recovery)
        t_new = next((r["time"] for r in restarts if r["child"] == who and r["time"] > t), float("inf"))
        back: Optional[float] = None
        if who.startswith("inference["):
            w = int(who[len("inference["):-1])
            back = next((e["t"] for e in events if e.get("ev") == "worker_back" and e["worker"] == w and e["t"] > t), None)
            if back is None:  # an orchestrator restarted meanwhile: it starts only once every worker is ready
                r = next((e["t"] for e in events if e.get("ev") == "restart" and e["t"] > t), None)
                back = r and next((e["t"] for e in events if e.get("ev") == "batch" and e["t"] > r), None)
        elif who.startswith("trainer"):
            back = next((r["time"] for r in metrics if r.get("time", 0) > t_new), None)
        elif who.startswith("orchestrator"):
            back = next((e["t"] for e in events if e.get("ev") == "batch" and e["t"] > t_new), None)
        k["recovery_s"] = round(back - t, 2) if back is not None else None
        recovery.append(k["recovery_s"])
    steps = [r["step"] for r in metrics]
    rec = [r for r in recovery if r is not None]
    rewards = [r["reward_mean"] for r in metrics[-5:]]
    return {
        "finished": finished,
        "num_steps": len(set(steps)),
        "steps_duplicated_in_metrics": len(steps) - len(set(steps)),
        "steps_missing_in_metrics": len(set(range(1, num_steps + 1)) - set(steps)),
        "kills": kills,
        "rollouts_lost": len(led.pending()) * cfg_samples if finished else None,
        "rollouts_trained_twice": led.summary()["groups_trained_twice"] * cfg_samples,
        "steps_lost": sum(r.get("steps_lost", 0) for r in resumes),
        "recovery_s_median": round(statistics.median(rec), 2) if rec else None,
        "recovery_s_max": max(rec) if rec else None,
        "recoveries_missing": len(recovery) - len(rec),
        "reward_final": round(sum(rewards) / len(rewards), 4) if rewards else None,
        "reward_first": round(sum(r["reward_mean"] for r in metrics[:5]) / max(1, len(metrics[:5])), 4),
        "ledger": led.summary(),
        "restarts": restarts,
    }


def _group_size(run_dir: Path) -> int:
    from workers.common.config import load_run_config
    return load_run_config(str(run_dir / "config" / "run.yaml")).orchestrator.num_samples_per_prompt


def default_schedule(num_steps: int, trainer_signal: str) -> list[tuple[int, str, str]]:
    s = max(num_steps, 30)
    return [(3, "inference[0]", "KILL"), (s // 5 + 2, "inference[1]", "KILL"), (s // 3 + 1, "trainer[0]", trainer_signal),
            (s // 2, "orchestrator[0]", "KILL"), (3 * s // 5, "inference[0]", "KILL"), (3 * s // 4, "inference[1]", "KILL")]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--trainer-signal", default="TERM", choices=["TERM", "KILL", "USR1"])
    ap.add_argument("--runs-root", default="/tmp/slurmrl-chaos")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "chaos.json"))
    ap.add_argument("--step-delay-s", type=float, default=0.5,
                    help="trainer.simulated_step_delay_s: a step as slow as a real trainer's, so a killed "
                         "worker can come back before the run ends")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    run_dir = Path(a.runs_root) / time.strftime("chaos-%Y%m%d-%H%M%S")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    r = run_chaos(run_dir, num_steps=a.steps, schedule=default_schedule(a.steps, a.trainer_signal),
                  overrides=[f"trainer.simulated_step_delay_s={a.step_delay_s}", *a.overrides])
    r["run_dir"] = str(run_dir)
    for k in r["kills"]:
        print(f"killed {k['child']:<16} SIG{k['signal']:<4} after step {k['after_step']:>3}: recovered in "
              f"{k['recovery_s']} s")
    for key in ("finished", "num_steps", "rollouts_lost", "rollouts_trained_twice", "steps_lost", "recovery_s_median",
                "recovery_s_max", "reward_first", "reward_final", "steps_duplicated_in_metrics",
                "steps_missing_in_metrics", "wall_s"):
        print(f"{key:<28} {r[key]}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(r, indent=1))
    ok = r["finished"] and r["rollouts_lost"] == 0 and r["rollouts_trained_twice"] == 0 and not r["recoveries_missing"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
