"""Calibrate the simulator's local (CPU) cost terms on real runs, and say how well it predicts.

Why: the cluster-scale answers rest on published anchors we cannot check here, but the
event logic and the loop rules can be checked against this machine: fit a handful of
cost terms on some local runs, then predict the step time of *other* runs (async vs
sync, other batch sizes, a slow trainer, heavy-tailed env latency) and report the error.

Terms (tiny MoE on 2 shared CPU cores, every role a process):
  decode   one engine iteration of n sequences: a + b * n   (prefill of newly admitted
           prompts, a few tokens each, costs one iteration of the same shape)
  trainer  busy seconds per step: c + d * tokens (load, forward/backward, optimizer, publish)
  pause    weight_update_s (pause -> load -> continue), median of the runs
  orch     CPU seconds the orchestrator spends per finished group, on the same cores
  CPUs     busy processes share cluster.num_cpus_per_node cores (engine.CpuPool)
  polling  the real loop's poll intervals: orchestrator 0.05 s, trainer 0.02 s (half each)

The trainer terms are fitted on sync runs' busy times; the decode terms so that the
simulated *sync* step time matches the sync calibration runs (it is linear in a and b);
the orchestrator term by a small grid on all calibration runs (async ones identify it).
Everything else is a prediction.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import statistics
from pathlib import Path
from typing import Optional

import yaml

from tools.simulator.costs import Replica
from tools.simulator.engine import Sim
from tools.simulator.layout import Layout
from tools.simulator.system import LoopConfig, System
from tools.simulator.workload import EnvWorkload

WARMUP = 5
ORCH_POLL_S = 0.05 / 2  # workers/orchestrator/loop.py: collect_finished(timeout_s=0.05)
TRAINER_POLL_S = 0.02 / 2  # workers/trainer/batch.py: wait_for_batch(poll_s=0.02)


@dataclasses.dataclass
class LocalCosts:
    decode_a: float = 2e-3
    decode_b: float = 1e-4
    train_a: float = 0.1
    train_b: float = 0.0
    pause_s: float = 0.015
    orch_cpu_s_per_group: float = 0.0
    cpu_cores: float = 2.0
    step_delay_s: float = 0.0
    max_batch_size: int = 64
    orch_poll_s: float = ORCH_POLL_S
    trainer_poll_s: float = TRAINER_POLL_S

    def decode_step_s(self, r: Replica, n: int, ctx: float) -> float:
        return self.decode_a + self.decode_b * n

    def unified_prefill_s(self, r: Replica, k: int, tokens: float) -> float:
        return self.decode_a + self.decode_b * k

    def max_running(self, r: Replica) -> int:
        return self.max_batch_size

    def kv_capacity_tokens(self, r: Replica, gpu_gb: float) -> float:
        return math.inf

    def kv_transfer_s(self, ctx: float) -> float:
        return 0.0

    def train_s(self, lengths) -> float:
        return self.train_a + self.train_b * sum(lengths)

    def train_sleep_s(self) -> float:
        return self.step_delay_s

    def weight_sync(self, replicas, transport: str = "filesystem", *, delta_fraction: float = 0.0) -> tuple[float, float]:
        return 0.0, self.pause_s  # publishing is inside the trainer's measured busy time


@dataclasses.dataclass
class RunRecord:
    name: str
    cfg: dict
    plan: dict
    period_s: float
    busy_s: float
    tokens: float
    completion_mean: float
    pause_s: float
    num_steps: int

    @property
    def label(self) -> str:
        o, t, e = self.cfg["orchestrator"], self.cfg["trainer"], self.cfg["env"]
        lat = e.get("latency", "none")
        return (f"off={o['max_off_policy_steps']} P={o['num_prompts_per_step']}x{o['num_samples_per_prompt']}"
                + (f" delay={t.get('simulated_step_delay_s', 0):g}s" if t.get("simulated_step_delay_s") else "")
                + (f" env={lat}({e.get('latency_median_s'):g}s)" if lat != "none" else ""))


def load_run(run_dir: str) -> Optional[RunRecord]:
    d = Path(run_dir)
    try:
        cfg = yaml.safe_load((d / "config" / "run.yaml").read_text())
        plan_file = d / "config" / "plan.json"  # older run dirs lack it: the workers are all the plan we need
        plan = (json.loads(plan_file.read_text()) if plan_file.exists()
                else {"roles": [{"role": "inference", "num_procs": cfg["inference"]["num_workers"]}]})
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return None
    if len(rows) < WARMUP + 10 or cfg.get("cluster", {}).get("backend") != "local":
        return None
    steady = rows[WARMUP:]
    delay = cfg["trainer"].get("simulated_step_delay_s", 0.0) or 0.0
    e = cfg["env"]
    prompt = (e["min_digits"] + e["max_digits"]) / 2 + 2
    pauses = [r["weight_update_s"] for r in steady if r.get("weight_update_s")]
    return RunRecord(name=d.name if d.name != "latest" else d.resolve().name, cfg=cfg, plan=plan,
                     period_s=(steady[-1]["time"] - steady[0]["time"]) / (len(steady) - 1),
                     busy_s=statistics.median(r["step_time_s"] for r in steady) - delay,
                     tokens=statistics.median(r["num_rows"] * prompt + r["num_loss_tokens"] for r in steady),
                     completion_mean=statistics.median(r["completion_len_mean"] for r in steady),
                     pause_s=statistics.median(pauses) if pauses else 0.015, num_steps=len(rows))


def simulate_run(run: RunRecord, costs: LocalCosts, *, steps: int = 40, seed: int = 0) -> dict:
    """Simulate one local run's configuration with ``costs``; returns System.summary()."""
    o, inf, t = run.cfg["orchestrator"], run.cfg["inference"], run.cfg["trainer"]
    workers = next(r["num_procs"] for r in run.plan["roles"] if r["role"] == "inference")
    layout = Layout(replicas=tuple(Replica(kind="unified", index=i, num_gpus=0, num_nodes=1) for i in range(workers)),
                    trainer_gpus=0, trainer_nodes=1, gpu_nodes=0)
    costs = dataclasses.replace(costs, step_delay_s=t.get("simulated_step_delay_s", 0.0) or 0.0,
                                max_batch_size=inf["max_batch_size"],
                                cpu_cores=run.cfg["cluster"].get("num_cpus_per_node", 2) or 2)
    env = type("Env", (), dict(run.cfg["env"]))
    loop = LoopConfig(groups_per_step=o["num_prompts_per_step"], group_size=o["num_samples_per_prompt"],
                      max_off_policy_steps=o["max_off_policy_steps"], max_inflight_rollouts=o["max_inflight_rollouts"],
                      num_steps=min(steps, run.num_steps), warmup_steps=WARMUP, seed=seed,
                      num_spare_groups=o.get("num_spare_groups", 0) or 0,
                      long_episode_policy=o.get("long_episode_policy", "drop") or "drop")
    system = System(Sim(), costs, layout, EnvWorkload(env, completion_mean=run.completion_mean), loop)
    system.run()
    return system.summary()


def _lsq(xs: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares for 1 or 2 unknowns (no numpy needed), clipped at >= 0."""
    if len(xs[0]) == 1 or len(xs) < 2:
        num = sum(x[0] * y for x, y in zip(xs, ys))
        return [max(0.0, num / max(sum(x[0] ** 2 for x in xs), 1e-18))] + [0.0] * (len(xs[0]) - 1)
    s11 = sum(x[0] * x[0] for x in xs); s12 = sum(x[0] * x[1] for x in xs); s22 = sum(x[1] * x[1] for x in xs)
    t1 = sum(x[0] * y for x, y in zip(xs, ys)); t2 = sum(x[1] * y for x, y in zip(xs, ys))
    det = s11 * s22 - s12 * s12
    if abs(det) < 1e-12 * max(s11 * s22, 1e-30):
        return _lsq([[x[0]] for x in xs], ys) + [0.0]
    a, b = (t1 * s22 - t2 * s12) / det, (s11 * t2 - s12 * t1) / det
    if a < 0 or b < 0:
        only_a = _lsq([[x[0]] for x in xs], ys)[0]
        return [only_a, 0.0]
    return [a, b]


def _decode_terms(sync: list[RunRecord], base: LocalCosts) -> LocalCosts:
    """Solve the sync step time (linear in a and b) for the decode terms, by finite differences."""
    a0, b0, da, db = 1e-4, 1e-6, 1e-3, 1e-5  # probes around a small base point (a zero step would never end)
    probe = {"0": (a0, b0), "a": (a0 + da, b0), "b": (a0, b0 + db)}
    rows, ys = [], []
    for r in sync:
        p = {k: simulate_run(r, dataclasses.replace(base, decode_a=a, decode_b=b))["step_s"] for k, (a, b) in probe.items()}
        ca, cb = (p["a"] - p["0"]) / da, (p["b"] - p["0"]) / db
        rows.append([ca, cb])
        ys.append(r.period_s - p["0"] + a0 * ca + b0 * cb)
    a, b = _lsq(rows, ys)
    return dataclasses.replace(base, decode_a=max(a, 1e-5), decode_b=b)


def fit(runs: list[RunRecord]) -> LocalCosts:
    """Trainer terms from sync busy times; decode terms from sync step times; the orchestrator's
    CPU per group (it competes with the trainer for the 2 cores) from the async runs, if any."""
    sync = [r for r in runs if r.cfg["orchestrator"]["max_off_policy_steps"] == 0] or runs
    c, d = _lsq([[1.0, r.tokens] for r in sync], [r.busy_s for r in sync])
    base = LocalCosts(train_a=c, train_b=d, pause_s=statistics.median(r.pause_s for r in runs))
    best, best_err = None, float("inf")
    for orch in (0.0, 1e-3, 2e-3, 4e-3, 8e-3, 16e-3, 32e-3) if len(sync) < len(runs) else (0.0,):
        costs = _decode_terms(sync, dataclasses.replace(base, orch_cpu_s_per_group=orch))
        err = sum((normalized(r, costs)[1]["step_s"] / r.period_s - 1) ** 2 for r in runs)
        if err < best_err:
            best, best_err = costs, err
    return best


def normalized(run: RunRecord, costs: LocalCosts) -> tuple[dict, dict, float]:
    """(raw prediction, prediction at this run's machine speed, the speed factor).

    The machine is shared: other jobs change its speed from run to run. The run's own
    trainer busy time measures it; every CPU term is scaled by measured / simulated busy.
    """
    raw = simulate_run(run, costs)
    speed = run.busy_s / max(raw["roles"]["trainer"]["busy"] * raw["step_s"], 1e-9)
    return raw, simulate_run(run, scaled(costs, speed)), speed


def find_runs(patterns: list[str]) -> list[RunRecord]:
    dirs = sorted({os.path.realpath(p) for pat in patterns for p in glob.glob(pat) if os.path.isdir(p)})
    return [r for r in (load_run(d) for d in dirs) if r is not None]


def calibrate(fit_runs: list[RunRecord], check_runs: list[RunRecord]) -> dict:
    """Fit on ``fit_runs``; predict every run; JSON-ready result with per-run errors."""
    costs = fit(fit_runs)
    fitted = {r.name for r in fit_runs}
    rows = []
    for r in sorted({x.name: x for x in fit_runs + check_runs}.values(), key=lambda x: x.name):
        s, n, speed = normalized(r, costs)
        rows.append({"run": r.name, "config": r.label, "used_for_fit": r.name in fitted, "measured_step_s": r.period_s,
                     "measured_trainer_busy_s": r.busy_s, "predicted_step_s": s["step_s"], "error": s["step_s"] / r.period_s - 1,
                     "predicted_trainer_idle": s["trainer_idle_frac"], "machine_slowdown": speed,
                     "predicted_step_s_normalized": n["step_s"], "error_normalized": n["step_s"] / r.period_s - 1})
    out = {"costs": dataclasses.asdict(costs), "runs": rows}
    for key in ("error", "error_normalized"):
        held = [abs(x[key]) for x in rows if not x["used_for_fit"]]
        out[f"held_out_mean_abs_{key}"] = sum(held) / len(held) if held else None
        out[f"held_out_max_abs_{key}"] = max(held) if held else None
    return out


def scaled(costs: LocalCosts, factor: float) -> LocalCosts:
    """Every CPU-time term times ``factor`` (a slower or faster machine); poll intervals stay."""
    return dataclasses.replace(costs, decode_a=costs.decode_a * factor, decode_b=costs.decode_b * factor,
                               train_a=costs.train_a * factor, train_b=costs.train_b * factor,
                               pause_s=costs.pause_s * factor, orch_cpu_s_per_group=costs.orch_cpu_s_per_group * factor)
