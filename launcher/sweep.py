"""Hydra multirun -> one heterogeneous job per sweep point.

    slurmrl -m trainer.lr=1e-4,3e-4 cluster=local_slurm

Hydra's basic launcher calls the task function once per point; in multirun mode the task
only *prepares* the point (plan + render, nothing written) and :func:`collect` keeps it.
When Hydra has gone through every point, :func:`run_all` checks them together (one run
directory each), then writes and submits them all: a bad value in the last point stops the
sweep before the first job is submitted. hydra-submitit-launcher cannot express hetjobs,
which is why the job itself is our own script (launcher/render.py), not submitit's.

The job ids are printed and written to ``<hydra.sweep.dir>/sweep.json``; by default the
sweep then waits until every job ended (``launcher.follow=false``: submit and return).
With cluster=local the points run one after the other as local processes.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Optional

from launcher import submit
from launcher.launch import Prepared, announce, launch, prepare, submit_prepared, write
from launcher.plan import PlanError
from launcher.pretrained import ensure_converted
from launcher.run_dir import choose_run_dir
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


def collect(cfg: RunConfig, *, num: int, overrides: list[str], sweep_dir: Optional[str]) -> None:
    """Prepare one point (raises PlanError on bad input); nothing is written yet."""
    root = None
    if not cfg.launcher.run_dir:
        base = choose_run_dir(cfg)
        root = base.with_name(f"{base.name}-p{num}")
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
    if points[0].prepared.plan.backend == "local":
        codes = [launch(p.prepared.cfg) for p in points]  # one at a time: they share this machine's cores
        return max(codes)
    jobs = []
    for p in points:
        ensure_converted(p.prepared.cfg)  # model.pretrained: once, before the first job needs it
        write(p.prepared)
        announce(p.prepared)
        jobs.append((p, submit_prepared(p.prepared)))
    print(f"[slurmrl] sweep: submitted {len(jobs)} jobs:", flush=True)
    for p, job_id in jobs:
        print(f"[slurmrl]   job {job_id}  #{p.num} {' '.join(varying(p, points)) or '-'}  {p.prepared.root}", flush=True)
    record(jobs)
    if not points[0].prepared.cfg.launcher.follow:
        return 0
    return wait_all(jobs)


def varying(point: Point, points: list[Point]) -> list[str]:
    """The point's overrides that not every point shares: what the sweep varies."""
    return [o for o in point.overrides if not all(o in q.overrides for q in points)]


def record(jobs: list[tuple[Point, str]]) -> None:
    sweep_dir = jobs[0][0].sweep_dir
    if not sweep_dir:
        return
    path = Path(sweep_dir) / "sweep.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([{"job_id": j, "num": p.num, "overrides": list(p.overrides),
                                 "run_dir": str(p.prepared.root)} for p, j in jobs], indent=1) + "\n")
    print(f"[slurmrl] sweep record: {path}", flush=True)


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
