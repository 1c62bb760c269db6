"""Cluster-scale discrete-event simulator of the RL system, driven by the launcher's JobPlan.

    python -m tools.simulator experiment=glm5_swe_28xh200 orchestrator.num_prompts_per_step=32
    python -m tools.simulator experiment=tiny_local          # local config, calibrated CPU terms
    python -m tools.simulator calibrate '/tmp/simcal/*/tiny_local-*' --fit A_sync16 B_sync4
    python -m tools.simulator experiment=glm5_swe_28xh200 --assumptions   # every number + source

Arguments without dashes are Hydra overrides, composed exactly as the ``slurmrl`` launcher
composes them, then planned with ``launcher.plan.build_plan``. For a GPU experiment it
prints: the configured split sync vs async (step time, GPU idle per role, bottleneck),
whether a step fits ``--budget-s``, the best split of the same nodes, the best split at
each ``--scale`` node count, and how the step time moves when one assumption moves.
Writes benchmarks/out/simulate_<experiment>.json and, with the split search, the plot
benchmarks/out/sim_node_split.png. Why a simulator at all: see tools/simulator/__init__.py.
``--record`` writes into the tracked benchmarks/results/ instead (benchmarks/record.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path

from tools.simulator import calibrate as cal
from tools.simulator import study
from tools.simulator.assumptions import Assumptions, table
from tools.simulator.costs import anchor_check
from tools.simulator.layout import layout_from_plan
from tools.simulator.workload import describe
from launcher.plan import PlanError, build_plan
from workers.common.config import RunConfig
from workers.common.registry import BACKENDS
from benchmarks.record import RECORDED, results_dir

RESULTS = results_dir()
CALIBRATION = RECORDED / "simulate_calibration.json"  # read from the record; --out writes elsewhere


def compose(overrides: list[str]) -> RunConfig:
    from hydra import compose as hydra_compose, initialize_config_module
    from omegaconf import OmegaConf

    from launcher.config_store import register

    register()
    overrides = ["launcher.dry_run=true", *overrides]  # planned, never started: plan-only model families are fine
    with initialize_config_module("hydra_conf", version_base=None):
        return OmegaConf.to_object(hydra_compose("config", overrides=overrides))


def fmt_table(header: list[str], rows: list[list]) -> str:
    cells = [header] + [[c if isinstance(c, str) else f"{c:.3g}" if isinstance(c, float) else str(c) for c in r]
                        for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def point_row(label: str, pt: study.Point, budget: float) -> list:
    s, r = pt.summary, pt.summary.get("roles", {})
    if "error" in s:
        return [label, pt.layout.label, s["error"]] + [""] * 8
    dec, pre = r.get("decode", {}), r.get("prefill", {})
    return [label, pt.layout.label, f"{s['step_s']:.0f}", "yes" if s["step_s"] <= budget else "no",
            pct(s["trainer_idle_frac"]), pct(1 - pre["busy"]) if pre else "-",
            f"{pct(1 - dec.get('busy', 0))} / {pct(1 - dec.get('util', 0))}",
            f"{s['rollout_latency_mean_s']:.0f} / {s['rollout_latency_p99_s']:.0f}", pct(s["samples_dropped_frac"]),
            s["bottleneck"]]


HEAD = ["run", "split", "step s", "fits", "trainer idle", "prefill idle", "decode idle/unused", "group s mean/p99",
        "dropped", "bottleneck"]
"""Columns: GPU idle per role; decode 'unused' = tokens/s not delivered vs the replica's KV-limited
capacity (busy but at a small batch); group s = launch to its slowest sample's end (GRPO needs all)."""


def run_cluster(cfg: RunConfig, args) -> dict:
    a = Assumptions()
    t0 = time.perf_counter()
    plan = build_plan(cfg)
    layout = layout_from_plan(plan)
    print("\n".join(plan.summary()))
    stats = describe(study.SweWorkload(a.swe), random.Random(args.seed))
    eff = anchor_check(a)
    print(f"workload (SWE, assumptions.py): {stats['tokens_mean']:.0f} tokens/rollout mean (p99 {stats['tokens_p99']:.0f}), "
          f"{stats['completion_mean']:.0f} generated, {stats['env_s_mean']:.0f} s env wait; "
          f"{cfg.orchestrator.num_prompts_per_step * cfg.orchestrator.num_samples_per_prompt} rollouts/step")
    print(f"derived from the anchors: prefill at {eff['eff_prefill']:.0%} of peak, decode compute at "
          f"{eff['eff_decode']:.0%} of peak (DeepSeek-V3 on H100, LMSYS 2025-05-05)")
    loop = study.loop_config(cfg, steps=args.steps, warmup=args.warmup, seed=args.seed, transport=args.transport)
    base = list(zip(("sync (max_off=0)", f"async (max_off={loop.max_off_policy_steps})"), study.simulate_many(
        [(cfg, layout, a, dataclasses.replace(loop, max_off_policy_steps=0)), (cfg, layout, a, loop)])))
    for note in base[1][1].layout.notes:
        print(f"memory: {note}")
    print(f"\nconfigured split ({base[1][1].layout.detail()}), weight update {base[1][1].summary.get('weight_sync_s', 0):.1f} s:")
    print(fmt_table(HEAD, [point_row(n, p, args.budget_s) for n, p in base]))
    asyn = base[1][1].summary
    if "latency_parts_s" in asyn:
        parts = ", ".join(f"{k} {v:.0f} s" for k, v in asyn["latency_parts_s"].items())
        print(f"async: a rollout spends {parts}; {asyn['tokens_per_step'] / 1e6:.1f}M tokens/step; "
              f"stale drops keep {asyn['train_tokens_mean']:.0f} tokens/rollout of {asyn['finished_tokens_mean']:.0f} finished")
    out = {"experiment": cfg.experiment, "rollouts_per_step": cfg.orchestrator.num_prompts_per_step * cfg.orchestrator.num_samples_per_prompt,
           "budget_s": args.budget_s, "workload": stats, "derived": eff,
           "configured": {n: {"split": p.layout.label, **p.summary} for n, p in base}}
    best_pt = base[1][1]
    if not args.no_search:
        pts, n = study.search(cfg, plan.num_gpu_nodes, a, loop, simulate_top=args.top)
        print(f"\nbest splits of {plan.num_gpu_nodes} nodes ({n} plans accepted by build_plan, best {len(pts)} by the fluid "
              f"bound simulated):")
        print(fmt_table(HEAD, [point_row(f"#{i + 1}", p, args.budget_s) for i, p in enumerate(pts)]))
        out["search"] = [{"split": p.layout.label, "detail": p.layout.detail(), "bound_s": p.bound_s, **p.summary} for p in pts]
        best_pt = min(pts + [best_pt], key=lambda p: p.step_s)
        base_row = {"nodes": plan.num_gpu_nodes, "split": best_pt.layout.label, "step_s": best_pt.step_s,
                    "rollouts_per_step": out["rollouts_per_step"]}
        out["scaling"] = scaling(cfg, plan.num_gpu_nodes, a, loop, args, base_row, weak=False)
        if args.weak:
            out["scaling_weak"] = scaling(cfg, plan.num_gpu_nodes, a, loop, args, base_row, weak=True)
        if args.plot:
            study.plot(args.plot, pts, plan.num_gpu_nodes, out["scaling"], args.budget_s, out.get("scaling_weak"))
            print(f"plot: {args.plot}")
    if not args.no_sensitivity and "step_s" in best_pt.summary:
        rows = study.sensitivity(cfg, best_pt.layout, a, loop, best_pt.step_s)
        print(f"\nsensitivity around {best_pt.layout.label} ({best_pt.step_s:.0f} s): one assumption moved at a time")
        print(fmt_table(["case", "step s", "change", "bottleneck"],
                        [[r["case"], f"{r['step_s']:.0f}", f"{100 * r['change']:+.0f}%", r["bottleneck"]] for r in rows]))
        out["sensitivity"] = rows
    print(f"\nsimulated in {time.perf_counter() - t0:.1f} s")
    return out


def scaling(cfg: RunConfig, base_nodes: int, a: Assumptions, loop, args, base_row: dict, *, weak: bool) -> list[dict]:
    """Best split per node count: same rollouts per step (strong) or rollouts per step x nodes (weak)."""
    rows, table_rows = [base_row], []
    for nodes in args.scale:
        variant = cfg
        if weak:
            prompts = max(1, round(cfg.orchestrator.num_prompts_per_step * nodes / base_nodes))
            variant = dataclasses.replace(cfg, orchestrator=dataclasses.replace(cfg.orchestrator, num_prompts_per_step=prompts,
                                          max_inflight_rollouts=max(cfg.orchestrator.max_inflight_rollouts,
                                                                    cfg.orchestrator.max_inflight_rollouts * nodes // base_nodes)))
        lp = dataclasses.replace(loop, groups_per_step=variant.orchestrator.num_prompts_per_step,
                                 max_inflight_rollouts=variant.orchestrator.max_inflight_rollouts)
        pts, n = study.search(variant, nodes, a, lp, simulate_top=args.top_scale, exhaustive=False)
        if not pts:
            continue
        b = pts[0]
        per_step = variant.orchestrator.num_prompts_per_step * variant.orchestrator.num_samples_per_prompt
        table_rows.append(point_row(f"{nodes} nodes, {per_step}/step", b, args.budget_s))
        rows.append({"nodes": nodes, "split": b.layout.label, "step_s": b.step_s, "detail": b.layout.detail(),
                     "rollouts_per_step": per_step, "candidates": n, **b.summary})
    kind = "rollouts/step grow with nodes" if weak else f"{base_row['rollouts_per_step']} rollouts/step at every size"
    print(f"\nscaling, {kind} (best of a coarse split grid per node count, {args.top_scale} simulated each):")
    print(fmt_table(HEAD, table_rows))
    return rows


def run_local(cfg: RunConfig, args) -> dict:
    if not CALIBRATION.exists():
        raise SystemExit(f"no {CALIBRATION}: run `python -m tools.simulator calibrate RUN_GLOB` first")
    calib = json.loads(CALIBRATION.read_text())
    costs = cal.LocalCosts(**calib["costs"])
    print_calibration(calib)
    plan = build_plan(cfg)
    record = cal.RunRecord(name="this config", cfg=dataclasses.asdict(cfg), plan=dataclasses.asdict(plan), period_s=0.0,
                           busy_s=0.0, tokens=0.0, completion_mean=(cfg.env.min_digits + cfg.env.max_digits) / 2 + 1,
                           pause_s=costs.pause_s, num_steps=args.steps * 4)
    s = cal.simulate_run(record, costs, steps=args.steps * 4)
    print(f"\n{cfg.experiment} as configured ({record.label}): predicted step {s['step_s']:.3f} s, trainer idle "
          f"{pct(s['trainer_idle_frac'])}, workers busy {pct(s['roles']['unified']['busy'])}; {s['bottleneck']}")
    return {"experiment": cfg.experiment, "predicted": s, "calibration": calib}


def print_calibration(calib: dict) -> None:
    c = calib["costs"]
    print(f"local terms (fitted): decode iteration {1e3 * c['decode_a']:.2f} ms + {1e3 * c['decode_b']:.3f} ms/seq, "
          f"trainer {c['train_a']:.3f} s + {1e6 * c['train_b']:.1f} us/token, weight update {1e3 * c['pause_s']:.0f} ms")
    rows = [[r["run"], r["config"], "fit" if r["used_for_fit"] else "held out", f"{r['measured_step_s']:.3f}",
             f"{r['predicted_step_s']:.3f}", f"{100 * r['error']:+.0f}%", f"x{r['machine_slowdown']:.2f}",
             f"{r['predicted_step_s_normalized']:.3f}", f"{100 * r['error_normalized']:+.0f}%"] for r in calib["runs"]]
    print(fmt_table(["run", "config", "role", "measured s/step", "predicted", "error", "machine speed (trainer)",
                     "pred. normalized", "error"], rows))
    if calib.get("held_out_mean_abs_error") is not None:
        print(f"held-out runs: mean |error| {100 * calib['held_out_mean_abs_error']:.0f}% (max "
              f"{100 * calib['held_out_max_abs_error']:.0f}%); normalized by each run's own trainer speed: "
              f"{100 * calib['held_out_mean_abs_error_normalized']:.0f}% (max "
              f"{100 * calib['held_out_max_abs_error_normalized']:.0f}%)")
    if calib.get("note"):
        print(calib["note"])


def main_calibrate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.simulator calibrate")
    p.add_argument("runs", nargs="*", default=["/tmp/runs/tiny_local-*"], help="run directories (globs)")
    p.add_argument("--fit", nargs="+", default=None, help="substrings of the run names to fit on (default: all sync runs)")
    p.add_argument("--out", default=str(RESULTS / "simulate_calibration.json"))
    p.add_argument("--note", default="", help="context stored with the result (e.g. the machine's load)")
    args = p.parse_args(argv)
    runs = cal.find_runs(args.runs)
    if not runs:
        raise SystemExit(f"no usable local runs in {args.runs}")
    fit_runs = [r for r in runs if any(f in r.name or f in r.cfg.get("cluster", {}).get("runs_root", "") for f in args.fit)] \
        if args.fit else [r for r in runs if r.cfg["orchestrator"]["max_off_policy_steps"] == 0]
    result = cal.calibrate(fit_runs, runs)
    result["note"] = args.note
    print_calibration(result)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["calibrate"]:
        return main_calibrate(argv[1:])
    p = argparse.ArgumentParser(prog="python -m tools.simulator", description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. experiment=glm5_swe_28xh200")
    p.add_argument("--steps", type=int, default=8, help="trainer steps simulated (warm-up included)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=300.0, help="step-time budget to check (default 5 minutes)")
    p.add_argument("--transport", choices=("broadcast", "filesystem"), default="broadcast")
    p.add_argument("--scale", default="64,256,1024", help="node counts for the scaling table ('' for none)")
    p.add_argument("--top", type=int, default=4, help="splits simulated at the configured node count")
    p.add_argument("--top-scale", type=int, default=2, help="splits simulated per scaling point")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes for independent simulations")
    p.add_argument("--weak", action="store_true", help="also scale rollouts/step with the node count (slower)")
    p.add_argument("--no-search", action="store_true")
    p.add_argument("--no-sensitivity", action="store_true")
    p.add_argument("--assumptions", action="store_true", help="print every assumption with its source and exit")
    p.add_argument("--plot", default=str(RESULTS / "sim_node_split.png"))
    p.add_argument("--json", default=None, help="default benchmarks/results/simulate_<experiment>.json")
    args = p.parse_args(argv)
    args.scale = [int(x) for x in args.scale.split(",") if x.strip()]
    study.JOBS = args.jobs
    if args.assumptions:
        print(fmt_table(["assumption", "value", "unit", "source"], [list(r) for r in table(Assumptions())]))
        return 0
    try:
        cfg = compose(args.overrides)
        # GPU backends (SGLang) are simulated as a cluster of replicas; CPU ones (embedded) as local workers
        gpu = BACKENDS.get(cfg.inference.backend).uses_gpus
        out = run_cluster(cfg, args) if gpu else run_local(cfg, args)
    except PlanError as e:
        print(f"simulate: error: {e}", file=sys.stderr)
        return 2
    path = Path(args.json or RESULTS / f"simulate_{cfg.experiment}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
