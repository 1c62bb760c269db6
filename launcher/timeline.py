"""The loop's timeline, joined by step into phases and one summary line (``RUN/timeline/``).

The roles write marks (workers/common/timeline.py says which and what ``generation_s`` means);
this joins them per step N into phases, each a duration in seconds:

============== =============================================================================
interval       trainer step N published - step N-1 published (what a step costs the run)
trainer_busy   published - batch_ready: load + train + publish (``trainer.step_time_s``)
generation     the batch's inference busy time, weight-update pauses left out
handoff        trainer saw READY - (the batch written, or the trainer waiting, whichever came later)
batch_write    the orchestrator writing batch N (safetensors + meta + READY)
assemble       last group of batch N finished -> its write started (the orchestrator's loop)
load           batch_ready -> the batch in device memory on every rank
train          train_step
publish        publish_weights (the trainer's side of the weight update)
apply_wait     trainer published weights N -> the orchestrator's swap to N began (its poll)
apply          the swap: pause -> load -> verify -> continue (generation resumed at its end;
               embedded engines generate through it: staged, swapped between decode steps)
reward         the slowest env step (scoring) among the batch's samples
engine_*       an embedded engine's own split of ``apply`` (its slowest worker): ``engine_read`` (the
               step read and checked), ``engine_stage`` (copied / patches verified beside decoding),
               ``engine_lock_wait`` (the decode block in flight ending), ``engine_swap``, ``engine_total``
============== =============================================================================

``loop_interval_over_bound`` = the median over steps of interval / max(trainer_busy, generation),
each of the same step: 1.0 when the run goes exactly as fast as its slower side; above it, the
rest is loop overhead, and the biggest of the other phases' medians (``biggest_other``) is where to
look first. Per step, not median over median: a run's step time drifts (answers grow or shrink,
another process takes the CPU, a checkpoint), and the median of a drifting series can fall between
two regimes, so a ratio of two medians taken over different steps may compare a slow step's
interval with a fast step's busy time (``interval_over_bound_of_medians`` keeps that ratio too).

Step 1 is left out of every median (compilation, graph capture, first weights). Torch-free.
"""
from __future__ import annotations

import os
import statistics
from typing import Optional

from workers.common.timeline import read_timeline

#: Phases other than the two sides of the bound (train and generation), candidates for ``biggest_other``.
OTHER_PHASES = ("handoff", "batch_write", "assemble", "load", "publish", "apply_wait", "apply", "reward")


def _diff(a: Optional[dict], b: Optional[dict], key_a: str, key_b: str) -> Optional[float]:
    if a is None or b is None or not isinstance(a.get(key_a), (int, float)) or not isinstance(b.get(key_b), (int, float)):
        return None
    return max(0.0, float(a[key_a]) - float(b[key_b]))


def engine_parts(apply: Optional[dict]) -> dict[str, float]:
    """The engine's own split of an ``apply`` (``engine_read_s`` ... in the record: the slowest worker's
    read, stage, lock_wait, swap and total seconds) as phases ``engine_read``, ``engine_stage`` ..."""
    return {k[:-2]: float(v) for k, v in (apply or {}).items()
            if k.startswith("engine_") and k.endswith("_s") and isinstance(v, (int, float))}


def step_phases(run_dir: str | os.PathLike) -> dict[int, dict[str, float]]:
    """``{step: {phase: seconds}}`` for every step with a trainer record (phases whose marks are missing are absent)."""
    tl = read_timeline(run_dir)
    trainer, batches = tl.get(("trainer", "step"), {}), tl.get(("orchestrator", "batch"), {})
    applies = tl.get(("orchestrator", "apply"), {})
    out: dict[int, dict[str, float]] = {}
    for n in sorted(trainer):
        t, b, a = trainer[n], batches.get(n), applies.get(n)
        ph = {"interval": _diff(t, trainer.get(n - 1), "published", "published"),
              "trainer_busy": _diff(t, t, "published", "batch_ready"),
              "generation": float(b["generation_s"]) if b and isinstance(b.get("generation_s"), (int, float)) else None,
              "handoff": _diff(t, {"at": max(b["batch_written"], t["wait_start"])}, "batch_ready", "at")
              if b and isinstance(b.get("batch_written"), (int, float)) else None,
              "batch_write": _diff(b, b, "batch_written", "write_start"),
              "assemble": _diff(b, b, "write_start", "last_group_done"),
              "load": _diff(t, t, "loaded", "batch_ready"),
              "train": _diff(t, t, "trained", "loaded"),
              "publish": _diff(t, t, "published", "trained"),
              "apply_wait": _diff(a, t, "start", "published"),
              "apply": _diff(a, a, "end", "start"),
              "reward": float(b["reward_s"]) if b and isinstance(b.get("reward_s"), (int, float)) else None,
              **engine_parts(a)}
        out[n] = {k: v for k, v in ph.items() if v is not None}
    return out


def summarize(run_dir: str | os.PathLike, *, skip_first: int = 1) -> dict:
    """Medians of every phase over steps > ``skip_first``, ``loop_interval_over_bound`` and ``biggest_other``
    (``{"steps": 0}`` when the run has no timeline yet)."""
    phases = {n: p for n, p in step_phases(run_dir).items() if n > skip_first}
    res: dict = {"steps": len(phases)}
    names = sorted({k for p in phases.values() for k in p})
    for k in names:
        vals = [p[k] for p in phases.values() if k in p]
        res[f"{k}_s_median"] = statistics.median(vals)
    interval, busy, gen = (res.get(f"{k}_s_median") for k in ("interval", "trainer_busy", "generation"))
    bound = max(busy or 0.0, gen or 0.0)
    res["bound_s"] = bound if bound > 0 else None
    res["interval_over_bound_of_medians"] = interval / bound if interval is not None and bound > 0 else None
    ratios = [p["interval"] / b for p in phases.values()
              if "interval" in p and (b := max(p.get("trainer_busy", 0.0), p.get("generation", 0.0))) > 0]
    res["loop_interval_over_bound"] = statistics.median(ratios) if ratios else None
    others = {k: res[f"{k}_s_median"] for k in OTHER_PHASES if f"{k}_s_median" in res}
    if others:
        name = max(others, key=others.__getitem__)
        res["biggest_other"], res["biggest_other_s"] = name, others[name]
    return res


def summary_line(run_dir: str | os.PathLike) -> Optional[str]:
    """One line for the end of a run and ``slurmrl status``; None when there is nothing to summarise."""
    s = summarize(run_dir)
    if s["loop_interval_over_bound"] is None:
        return None
    other = (f"; biggest other phase: {s['biggest_other']} {s['biggest_other_s']:.3f} s" if "biggest_other" in s else "")
    order = ("read", "stage", "lock_wait", "swap")  # the update's own order (weight_swap.py)
    parts = sorted(((k[len("engine_"):-len("_s_median")], v) for k, v in s.items()
                    if k.startswith("engine_") and k.endswith("_s_median") and k != "engine_total_s_median"),
                   key=lambda kv: (order.index(kv[0]) if kv[0] in order else len(order), kv[0]))
    if s.get("biggest_other") == "apply" and parts:  # where the engine's update went
        other += " (engine: " + ", ".join(f"{k} {v:.3f}" for k, v in parts) + ")"
    return (f"timeline ({s['steps']} steps, medians): interval {s['interval_s_median']:.3f} s, trainer busy "
            f"{s.get('trainer_busy_s_median', 0.0):.3f} s, generation {s.get('generation_s_median', 0.0):.3f} s/batch, "
            f"loop_interval_over_bound {s['loop_interval_over_bound']:.2f}{other}")
