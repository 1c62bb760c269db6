"""Hydra multirun -> one heterogeneous job per sweep point.

    slurmrl -m trainer.lr=1e-4,3e-4 cluster=local_slurm

Hydra's basic launcher calls the task function once per point; in multirun mode the task
only *prepares* the point (plan + render, nothing written) and :func:`collect` keeps it.
When Hydra has gone through every point, :func:`run_all` checks them together (one run
directory each), then writes and submits them all: a bad value in the last point stops the
sweep before the first job is submitted. hydra-submitit-launcher cannot express hetjobs,
which is why the job itself is our own script (launcher/render.py), not submitit's.

Each sweep, local or Slurm, dry or not, has its own directory (``<runs_root>/multirun/<time>``)
whose ``sweep.json`` lists every point (a point's run directory ``<name>-p<N>``, suffixed
``-2`` ... when an earlier sweep of the same name holds it): job id, job name (``slurmrl-<experiment>-<hash>-<swept values>``), overrides, run
directory and script. ``launcher.dry_run=true`` renders and writes every point and submits
nothing. By default the sweep then waits until every job ended (``launcher.follow=false``:
submit and return).
With cluster=local the points run one after the other as local processes.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import time
from pathlib import Path
from typing import Optional

from launcher import submit
from launcher.launch import Prepared, announce, launch, prepare, submit_prepared, write
from launcher.plan import PlanError
from launcher.pretrained import ensure_converted
from launcher.run_dir import choose_run_dir, free_dir, run_label
from launcher.run_status import last_eval, local_state, records, trained
from workers.common.protocol import RunPaths
from workers.common.config import RunConfig


@dataclasses.dataclass(frozen=True)
class Point:
    num: int
    """Hydra's job number of the point."""
    overrides: tuple[str, ...]
    """The point's overrides (what differs between points)."""
    prepared: Prepared
    sweep_dir: Optional[str]


POINTS: list[Point] = []
MAX_VALUES_CHARS = 64
"""Swept values kept in a job name (the hash tells cut names apart)."""


def collect(cfg: RunConfig, *, num: int, overrides: list[str], sweep_dir: Optional[str]) -> None:
    """Prepare one point (raises PlanError on bad input); nothing is written yet."""
    root = None
    if not cfg.launcher.run_dir:
        base = choose_run_dir(cfg)
        root = free_dir(base.with_name(f"{base.name}-p{num}"))  # a re-used name= is suffixed, never refused
    POINTS.append(Point(num=num, overrides=tuple(overrides), prepared=prepare(cfg, root=root), sweep_dir=sweep_dir))


def check_points(points: list[Point]) -> None:
    roots = [p.prepared.root for p in points]
    dup = sorted({str(r) for r in roots if roots.count(r) > 1})
    if dup:
        raise PlanError(f"launcher.run_dir: sweep points share run directories {dup}; leave launcher.run_dir unset "
                        f"(one directory per point is chosen) or sweep over it")
    backends = {p.prepared.plan.backend for p in points}
    if len(backends) > 1:
        raise PlanError(f"cluster.backend differs between sweep points ({sorted(backends)}); sweep one backend at a time")


def run_all(points: Optional[list[Point]] = None) -> int:
    points = list(POINTS if points is None else points)
    if not points:
        return 0
    check_points(points)
    points = [named(p, points) for p in points]
    dry = points[0].prepared.cfg.launcher.dry_run
    if points[0].prepared.plan.backend == "local":
        record([(p, None) for p in points], dry=dry)  # before the first point runs: the manifest of the sweep
        codes = [launch(p.prepared.cfg) for p in points]  # one at a time: they share this machine's cores
        if not dry:
            results(points)
        return max(codes)
    if dry:  # every point rendered and written, nothing submitted
        for p in points:
            write(p.prepared)
            announce(p.prepared)
        print(f"[slurmrl] sweep dry run: {len(points)} jobs rendered, none submitted:", flush=True)
        for p in points:
            print(f"[slurmrl]   #{p.num} {p.prepared.plan.slurm.job_name}  {p.prepared.script_path}", flush=True)
        record([(p, None) for p in points], dry=True)
        return 0
    jobs = []
    for p in points:
        ensure_converted(p.prepared.cfg)  # model.pretrained: once, before the first job needs it
        write(p.prepared)
        announce(p.prepared)
        jobs.append((p, submit_prepared(p.prepared)))
    print(f"[slurmrl] sweep: submitted {len(jobs)} jobs:", flush=True)
    for p, job_id in jobs:
        print(f"[slurmrl]   job {job_id}  #{p.num} {p.prepared.plan.slurm.job_name}  {p.prepared.root}", flush=True)
    record(jobs, dry=False)
    if not points[0].prepared.cfg.launcher.follow:
        return 0
    code = wait_all(jobs)
    results(points)
    return code


def varying(point: Point, points: list[Point]) -> list[str]:
    """The point's overrides that not every point shares: what the sweep varies."""
    return [o for o in point.overrides if not all(o in q.overrides for q in points)]


def job_name(experiment: str, swept: list[str]) -> str:
    """``slurmrl-<experiment>-<6-hex hash of the swept overrides>-<their values>``: squeue tells the
    points apart, and the hash stays unique when the values are cut to keep the name short."""
    digest = hashlib.sha1("\n".join(sorted(swept)).encode()).hexdigest()[:6]
    values = ",".join(f"{o.split('=', 1)[0].rsplit('.', 1)[-1]}={o.split('=', 1)[-1]}" for o in swept)
    values = re.sub(r"[^A-Za-z0-9._=,+-]", "_", values)[:MAX_VALUES_CHARS]
    return "-".join(x for x in (f"slurmrl-{experiment}", digest, values) if x)


def named(point: Point, points: list[Point]) -> Point:
    """The point re-prepared with its own job name (unless launcher.job_name was given)."""
    cfg = point.prepared.cfg
    if cfg.launcher.job_name or cfg.cluster.backend == "local":
        return point
    cfg = dataclasses.replace(cfg, launcher=dataclasses.replace(cfg.launcher,
                                                                job_name=job_name(cfg.name or run_label(cfg), varying(point, points))))
    return dataclasses.replace(point, prepared=prepare(cfg, root=point.prepared.root))


def record(jobs: list[tuple[Point, Optional[str]]], *, dry: bool) -> None:
    """``<sweep dir>/sweep.json``: one entry per point (job id, job name, overrides, run dir, script);
    local points have no job id and no script (they run one after the other on this machine)."""
    sweep_dir = jobs[0][0].sweep_dir
    if not sweep_dir:
        return
    path = Path(sweep_dir) / "sweep.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    entries = [{"job_id": j, "num": p.num, "job_name": p.prepared.plan.slurm.job_name, "overrides": list(p.overrides),
                "run_dir": str(p.prepared.root),
                "script": str(p.prepared.script_path) if p.prepared.script is not None else None} for p, j in jobs]
    path.write_text(json.dumps({"dry_run": dry, "backend": jobs[0][0].prepared.plan.backend, "points": entries},
                               indent=1) + "\n")
    print(f"[slurmrl] sweep manifest: {path}", flush=True)


def results(points: list[Point]) -> str:
    """The sweep's table: one row per point (its swept values, state, steps, final reward = mean of
    the last 5 steps, last eval with the step it evaluated), printed and written beside sweep.json
    as ``sweep_results.txt`` and ``sweep_results.json``."""
    rows = []
    for p in points:
        root = p.prepared.root
        recs = records(RunPaths(root))
        ev = last_eval(recs)
        recs = trained(recs)
        rewards = [r["reward_mean"] for r in recs if isinstance(r.get("reward_mean"), (int, float))]
        rows.append({"point": p.num, "swept": " ".join(varying(p, points)) or "-",
                     "state": local_state(root, len(recs)),
                     "steps": len(recs), "final_reward": sum(rewards[-5:]) / len(rewards[-5:]) if rewards else None,
                     "eval": ev[0] if ev else None, "eval_weights_step": ev[1] if ev else None, "run_dir": str(root)})
    head = ("#", "SWEPT", "STATE", "STEPS", "FINAL REWARD", "EVAL", "RUN")
    body = [(str(r["point"]), r["swept"], r["state"], str(r["steps"]),
             "-" if r["final_reward"] is None else f"{r['final_reward']:.3f}",
             "-" if r["eval"] is None else f"{r['eval']:.3f} @{r['eval_weights_step']}", r["run_dir"]) for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    text = "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [head, *body])
    print(f"[slurmrl] sweep results (final reward: mean of the last 5 steps; eval @ the weights' step):\n{text}",
          flush=True)
    sweep_dir = points[0].sweep_dir
    if sweep_dir:
        Path(sweep_dir).mkdir(parents=True, exist_ok=True)
        (Path(sweep_dir) / "sweep_results.txt").write_text(text + "\n")
        (Path(sweep_dir) / "sweep_results.json").write_text(json.dumps(rows, indent=1) + "\n")
        print(f"[slurmrl] sweep results: {Path(sweep_dir) / 'sweep_results.txt'}", flush=True)
    return text


def wait_all(jobs: list[tuple[Point, str]], *, poll_s: float = 2.0) -> int:
    """Wait until every job ended; one line per state change. 0 iff every job COMPLETED."""
    last: dict[str, str] = {}
    final: dict[str, str] = {}
    try:
        while len(final) < len(jobs):
            for _, job_id in jobs:
                if job_id in final:
                    continue
                comps = submit.components(job_id)
                state = submit.overall_state(comps)
                if last.get(job_id) != state:
                    print(f"[slurmrl] job {job_id}: {state}", flush=True)
                    last[job_id] = state
                if not any(c.state in submit.ACTIVE for c in comps):
                    final[job_id] = state
            if len(final) < len(jobs):
                time.sleep(poll_s)
    except KeyboardInterrupt:
        print("\n[slurmrl] stopped waiting; the jobs keep running (slurmrl status RUN_DIR)", flush=True)
        return 130
    bad = {j: s for j, s in final.items() if s != "COMPLETED"}
    print(f"[slurmrl] sweep: {len(jobs) - len(bad)}/{len(jobs)} jobs COMPLETED"
          + (f"; not completed: {bad}" if bad else ""), flush=True)
    return 1 if bad else 0
