"""Chaos benchmark: a local run that keeps training while its processes are killed.

    python -m benchmarks.chaos [--steps 30] [--out benchmarks/out/chaos.json] [overrides...]

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
- ``steps_lost`` (= ``steps_redone``): trainer steps redone after a resume, from step 0 too
  (checkpoints/resumes.jsonl; ``resumes``: how many),
- ``recovery_s``: kill -> the victim is useful again (worker: the orchestrator revived it at
  the current weights; trainer: the restarted process's first step record; orchestrator: the
  restarted process's first batch), median and max,
- ``reward_final``: mean reward of the last 5 steps; metrics.jsonl must hold each step once,
- ``held_s``: how long the run was held at its end so a late kill's recovery could be
  observed (:class:`Hold`: the trainer paused while a killed worker is not back, bounded).
Prints a table and writes JSON. Tests reuse :func:`run_chaos` with smaller schedules.
``--record`` writes into the tracked benchmarks/results/ instead (benchmarks/record.py).
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
from benchmarks.record import results_dir

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


HOLD_MAX_S = 180.0
"""Longest the run is held at its end for a recovery still to come (:class:`Hold`)."""


def _worker_back_after(run_dir: Path, worker: int, t: float) -> bool:
    return any(e.get("ev") == "worker_back" and e.get("worker") == worker and e.get("t", 0) > t
               for e in _read_jsonl(run_dir / "orchestrator_ledger.jsonl"))


class Hold:
    """Keep the run going until every kill's recovery is observed (bounded).

    A kill late in the run (steps of 0.6 s) landed a few seconds before the end: the orchestrator
    wrote its last batch and exited, nothing could revive the worker, and the benchmark failed a
    healthy run. The orchestrator writes batch N once it has samples of a recent enough policy, so
    it still needs the workers only while the trainer is below ``last = num_steps -
    max_off_policy_steps - 2``. Worker kills scheduled later are moved to ``last`` (:meth:`clamp`),
    and once the trainer reaches ``last`` with such a kill still to come or a killed worker not back, the
    trainer ranks are paused (SIGSTOP by PID) until the orchestrator readmitted it or
    ``HOLD_MAX_S`` passed in all (SIGCONT); ``held_s`` is reported. With a staleness window as long
    as the run (``last`` < 1) the orchestrator may finish at any time: nothing is held or moved."""

    def __init__(self, run_dir: Path, num_steps: int, max_s: float = HOLD_MAX_S):
        self.run_dir, self.num_steps, self.max_s = run_dir, num_steps, max_s
        self.paused: list[int] = []
        self.since: Optional[float] = None
        self.held_s = 0.0
        self.last: Optional[int] = None
        self.checked = 0.0

    def last_step(self) -> Optional[int]:
        """The last step at which the orchestrator surely still runs (None: config not written yet)."""
        if self.last is None:
            try:
                from workers.common.config import load_run_config

                off = load_run_config(str(self.run_dir / "config" / "run.yaml")).orchestrator.max_off_policy_steps
            except Exception:  # not written yet
                return None
            self.last = self.num_steps - off - 2
        return self.last

    def clamp(self, pending: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
        """The schedule with every inference kill after :meth:`last_step` moved to it (a trainer or
        orchestrator kill stays where it is: the run cannot end before those recover)."""
        last = self.last_step()
        if last is None or last < 1:
            return pending
        return sorted((min(at, last) if child.startswith("inference[") else at, child, sig)
                      for at, child, sig in pending)

    def _signal(self, sig: int) -> None:
        for pid in self.paused:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def update(self, kills: list[dict], schedule_left: int) -> None:
        if time.monotonic() - self.checked < 0.5:
            return  # the ledger is read at most twice a second
        self.checked = time.monotonic()
        waiting = [k for k in kills if k["child"].startswith("inference[") and not k.get("back")]
        for k in waiting:
            k["back"] = _worker_back_after(self.run_dir, int(k["child"][len("inference["):-1]), k["time"])
        waiting = [k for k in waiting if not k["back"]]
        last = self.last_step()
        if self.since is None:
            if ((waiting or schedule_left) and last is not None and last >= 1 and self.held_s < self.max_s
                    and _steps_done(self.run_dir) >= last):
                self.paused = [pid for name, pid in _children(self.run_dir).items() if name.startswith("trainer[")]
                self.since = time.monotonic()
                self._signal(signal.SIGSTOP)
        elif not (waiting or schedule_left) or self.held_s + time.monotonic() - self.since > self.max_s:
            self.release()

    def release(self) -> None:
        if self.since is not None:
            self._signal(signal.SIGCONT)
            self.held_s += time.monotonic() - self.since
            self.since, self.paused = None, []


def _children(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "pids.json").read_text())["children"]
    except (OSError, ValueError, KeyError):
        return {}


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
    hold = Hold(run_dir, num_steps)
    try:
        while proc.poll() is None:
            pending = hold.clamp(pending)
            hold.update(kills, sum(child.startswith("inference[") for _, child, _ in pending))
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
        hold.release()
        if proc.poll() is None:
            proc.kill()
        log.close()
    for k in kills:
        k.pop("back", None)
    report = measure(run_dir, kills, num_steps)
    report["held_s"] = round(hold.held_s, 1)
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
        "steps_redone": sum(r.get("steps_lost", 0) for r in resumes),  # the same count, by its other name
        "resumes": len(resumes),
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
    ap.add_argument("--out", default=str(results_dir() / "chaos.json"))
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
    for key in ("finished", "num_steps", "rollouts_lost", "rollouts_trained_twice", "steps_redone", "resumes",
                "recovery_s_median", "recovery_s_max", "recoveries_missing", "held_s", "reward_first", "reward_final",
                "steps_duplicated_in_metrics", "steps_missing_in_metrics", "wall_s"):
        print(f"{key:<28} {r[key]}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(r, indent=1))
    ok = r["finished"] and r["rollouts_lost"] == 0 and r["rollouts_trained_twice"] == 0 and not r["recoveries_missing"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
