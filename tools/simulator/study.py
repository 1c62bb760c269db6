"""Studies on top of one simulation: node-split search, scaling, sensitivity, the plot.

Why a fluid bound first: a split search at 1024 nodes has thousands of candidates and a
simulation takes about a second, so every candidate gets a cheap lower bound on its step
time (the largest of trainer seconds, prefill seconds and decode seconds per step at full
throughput, and mean rollout latency / steps in flight) and only the best few by that
bound are simulated. At 28 nodes the candidates are few and all are simulated.
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import random
from concurrent.futures import ProcessPoolExecutor
from typing import Optional

from tools.simulator.assumptions import Assumptions
from tools.simulator.costs import ClusterCosts
from tools.simulator.engine import Sim
from tools.simulator.layout import Layout, candidate_splits, fit_memory, layout_from_plan, with_split
from tools.simulator.system import LoopConfig, System
from tools.simulator.workload import SweWorkload
from launcher.plan import PlanError, build_plan
from workers.common.config import RunConfig
from workers.common.dtypes import FLOAT8, held_dtype


@dataclasses.dataclass
class Point:
    layout: Layout
    summary: dict
    bound_s: float = 0.0

    @property
    def step_s(self) -> float:
        return self.summary.get("step_s", float("inf"))


def costs_for(cfg: RunConfig, layout: Layout, a: Assumptions) -> ClusterCosts:
    sg = getattr(cfg.inference, "sglang", None)
    if sg is not None and "fp8" in str(getattr(sg, "quantization", "") or ""):
        a = a.with_changes({"serving.fp8_inference": True})
    if cfg.inference.dtype == FLOAT8:  # the embedded engine's fp8 GEMMs
        a = a.with_changes({"serving.fp8_inference": True})
    return ClusterCosts(cfg.model, a, infer_dtype=held_dtype(cfg.inference.dtype), trainer_gpus=layout.trainer_gpus,
                        trainer_nodes=layout.trainer_nodes, max_batch_size=cfg.inference.max_batch_size,
                        mem_fraction=getattr(sg, "mem_fraction_static", 0.0) or 0.0)


def delta_fraction_of(cfg: RunConfig, transport: str) -> float:
    """The changed fraction the plan assumes for sparse updates (0: dense), over either transport."""
    w = cfg.weights
    return getattr(w, "delta_fraction_assumed", 0.0) if getattr(w, "delta", False) else 0.0


def loop_config(cfg: RunConfig, *, steps: int, warmup: int, seed: int, transport: str,
                max_off: Optional[int] = None) -> LoopConfig:
    o = cfg.orchestrator
    return LoopConfig(groups_per_step=o.num_prompts_per_step, group_size=o.num_samples_per_prompt,
                      max_off_policy_steps=o.max_off_policy_steps if max_off is None else max_off,
                      max_inflight_rollouts=o.max_inflight_rollouts, num_steps=steps, warmup_steps=warmup,
                      transport=transport, seed=seed, delta_fraction=delta_fraction_of(cfg, transport), num_spare_groups=getattr(o, "num_spare_groups", 0),
                      long_episode_policy=getattr(o, "long_episode_policy", "drop"))


def simulate(cfg: RunConfig, layout: Layout, a: Assumptions, loop: LoopConfig) -> Point:
    costs = costs_for(cfg, layout, a)
    layout = fit_memory(layout, costs, cfg.cluster.gpu_memory_gb)
    segments = segments_for(cfg, layout, costs, loop, a)
    system = System(Sim(), costs, layout, SweWorkload(a.swe, max_segments=segments), loop, gpu_gb=cfg.cluster.gpu_memory_gb)
    system.run()
    pt = Point(layout, system.summary())
    pt.summary["segments_per_rollout"] = segments
    return pt


def segments_for(cfg: RunConfig, layout: Layout, costs: ClusterCosts, loop: LoopConfig, a: Assumptions) -> int:
    """Merge turns (8 segments per rollout, ~5x fewer events) unless the prefill replicas' prefix
    caches are near their working set (0.4 < W / C < 2.5): there, whether a rollout's next turn
    still finds its prefix depends on the turn-by-turn order of accesses, and merged turns get
    it wrong (tests/unit/simulator/test_sim_model.py::test_turn_merging_matches_per_turn_away_from_the_cache_edge)."""
    pre = layout.of("prefill")
    if not pre:
        return 8
    inflight = min(loop.max_inflight_rollouts, (max(1, loop.max_off_policy_steps) + 1) * loop.groups_per_step * loop.group_size)
    w = inflight * _mean_tokens(a) / 2 / len(pre)
    c = costs.prefix_cache_tokens(pre[0], cfg.cluster.gpu_memory_gb)
    return 1000 if 0.4 < w / max(c, 1.0) < 2.5 else 8


def _mean_tokens(a: Assumptions) -> float:
    return workload_stats(a)["tokens_mean"]


def fluid_bound(cfg: RunConfig, layout: Layout, a: Assumptions, loop: LoopConfig, stats: dict) -> float:
    """Lower bound on the step time (module docstring); ``stats`` from workload.describe-like sampling."""
    costs = costs_for(cfg, layout, a)
    layout = fit_memory(layout, costs, cfg.cluster.gpu_memory_gb)
    per_step = loop.groups_per_step * loop.group_size
    train = costs.train_s([int(stats["tokens_mean"])] * per_step)
    pre = layout.of("prefill")
    prefill = (per_step * costs.prefill_flops(stats["tokens_mean"], 0) / sum(costs.prefill_rate(r) for r in pre)
               if pre else 0.0)
    dec = layout.of("decode")
    ctx = stats["tokens_mean"] / 2
    cap = 0.0
    for r in dec:
        n = int(max(1, min(costs.max_running(r), costs.kv_capacity_tokens(r, cfg.cluster.gpu_memory_gb) / ctx)))
        cap += n / costs.decode_step_s(r, n, n * ctx)
    decode = per_step * stats["completion_mean"] / max(cap, 1e-9)
    itl = costs.decode_step_s(dec[0], 1, ctx) if dec else 0.0
    latency = stats["completion_mean"] * itl + stats["env_s_mean"]
    return max(train, prefill, decode, latency / max(1, loop.max_off_policy_steps))


_STATS: dict = {}
JOBS = 1  # worker processes for independent simulations (tools/simulator/cli.py --jobs)


def simulate_many(args: list[tuple]) -> list[Point]:
    """``simulate(*a)`` for each tuple, over JOBS forked processes (each simulation is independent)."""
    if JOBS <= 1 or len(args) <= 1:
        return [simulate(*a) for a in args]
    with ProcessPoolExecutor(max_workers=min(JOBS, len(args)), mp_context=multiprocessing.get_context("fork")) as ex:
        return list(ex.map(_simulate_star, args))


def _simulate_star(a: tuple) -> Point:
    return simulate(*a)


def workload_stats(a: Assumptions, seed: int = 0) -> dict:
    """Sampled workload statistics (cached per assumption set)."""
    key = (a.swe, seed)
    if key not in _STATS:
        from tools.simulator.workload import describe
        _STATS[key] = describe(SweWorkload(a.swe), random.Random(seed), n=1500)
    return _STATS[key]


def coarse_splits(cfg: RunConfig, total: int) -> list[RunConfig]:
    """Candidates at large node counts: trainer share x prefill share, 2-node prefill, 4/8-node decode."""
    par, gpn = cfg.trainer.parallel, cfg.cluster.num_gpus_per_node
    unit = max(1, par.tp * par.pp * par.ep * par.cp // gpn)
    samples = cfg.orchestrator.num_prompts_per_step * cfg.orchestrator.num_samples_per_prompt
    most = samples // gpn // unit * unit  # the plan wants >= 1 sample per trainer rank
    trainers = sorted({min(most, max(2 * unit, round(total * f / unit) * unit)) for f in (0.125, 0.25, 0.375, 0.5)})
    out = []
    for t in trainers:
        rest = total - t
        for d_size in (4, 8):
            for fp in (0.15, 0.25, 0.35, 0.5):
                p_num = max(1, round(rest * fp / 2))
                d_num = (rest - 2 * p_num) // d_size
                if d_num < 1:
                    continue
                p_num += (rest - 2 * p_num - d_num * d_size) // 2  # even leftovers become prefill replicas
                out.append(with_split(cfg, prefill=(p_num, 2), decode=(d_num, d_size), trainer_nodes=t))
    return out


def search(cfg: RunConfig, total: int, a: Assumptions, loop: LoopConfig, *, simulate_top: int = 6,
           exhaustive: bool = True) -> tuple[list[Point], int]:
    """Best splits of ``total`` GPU nodes; returns (simulated points sorted by step time, candidates)."""
    stats = workload_stats(a)
    if exhaustive:
        variants = [v for v, _ in candidate_splits(cfg, total, replica_nodes=(2, 4, 8))]
    else:
        variants = []
        for v in coarse_splits(cfg, total):
            try:
                build_plan(v)
                variants.append(v)
            except PlanError:
                continue
    scored = []
    for v in variants:
        lay = layout_from_plan(build_plan(v))
        scored.append((fluid_bound(v, lay, a, loop, stats), v, lay))
    scored.sort(key=lambda x: x[0])
    top = scored[:simulate_top]
    points = simulate_many([(v, lay, a, loop) for _, v, lay in top])
    for pt, (bound, _, _) in zip(points, top):
        pt.bound_s = bound
    points.sort(key=lambda p: p.step_s)
    return points, len(variants)


def sensitivity(cfg: RunConfig, layout: Layout, a: Assumptions, loop: LoopConfig, base_s: float) -> list[dict]:
    """Step time when one assumption moves (the answer to 'which assumptions dominate')."""
    cases = [
        ("decode step overhead 10 -> 20 ms", {"serving.decode_step_overhead_s": 0.02}, {}),
        ("FP8 inference (weights + GEMMs)", {"serving.fp8_inference": True}, {}),
        ("MTP speculative decoding, 1.8 tok/step", {"serving.spec_tokens_per_step": 1.8}, {}),
        ("HiCache: 1 TB/node host prefix cache", {"serving.host_cache_gb_per_node": 1000.0}, {}),
        ("turns per episode x0.5", {"swe.turns_median": a.swe.turns_median / 2}, {}),
        ("env latency x4", {"swe.tool_latency_median_s": a.swe.tool_latency_median_s * 4,
                            "swe.reward_latency_median_s": a.swe.reward_latency_median_s * 4}, {}),
        ("max_off_policy_steps 2 -> 4", {}, {"max_off_policy_steps": 4}),
        ("weights via filesystem (100 GB/s)", {}, {"transport": "filesystem"}),
        ("FP8 + MTP 1.8", {"serving.fp8_inference": True, "serving.spec_tokens_per_step": 1.8}, {}),
        ("FP8 + MTP 1.8 + HiCache + max_off 4", {"serving.fp8_inference": True, "serving.spec_tokens_per_step": 1.8,
                                                "serving.host_cache_gb_per_node": 1000.0}, {"max_off_policy_steps": 4}),
    ]
    points = simulate_many([(cfg, layout, a.with_changes(changes), dataclasses.replace(loop, **loop_changes))
                            for _, changes, loop_changes in cases])
    return [{"case": name, "step_s": pt.step_s, "change": pt.step_s / base_s - 1, "bottleneck": pt.summary.get("bottleneck", "")}
            for (name, _, _), pt in zip(cases, points)]


def plot(path: str, split_points: list[Point], total: int, scale: list[dict], budget_s: float,
         weak: Optional[list[dict]] = None) -> None:
    """Left: step time of each simulated split of ``total`` nodes. Right: best step time vs nodes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1.5, 1]})
    pts = sorted(split_points, key=lambda p: p.step_s)
    colors = ["tab:green" if p.step_s <= budget_s else "tab:red" for p in pts]
    ax1.bar(range(len(pts)), [p.step_s / 60 for p in pts], color=colors)
    ax1.axhline(budget_s / 60, color="k", ls="--", lw=1, label=f"{budget_s / 60:.0f}-minute budget")
    ax1.set_xticks(range(len(pts)), [p.layout.label.replace(" ", "\n") for p in pts], fontsize=7)
    ax1.set_yscale("log")
    ax1.set_ylabel("simulated step time (min, log)")
    ax1.set_title(f"{total} H200 nodes: prefill / decode / trainer split\n(replicas x nodes each; T = trainer nodes)",
                  fontsize=10)
    ax1.legend(fontsize=8)
    for series, style, name in ((scale, "o-", "same rollouts/step"), (weak or [], "s--", "rollouts/step x nodes")):
        if not series:
            continue
        ax2.plot([r["nodes"] for r in series], [r["step_s"] / 60 for r in series], style, label=name)
        for r in series:
            ax2.annotate(r["split"], (r["nodes"], r["step_s"] / 60), fontsize=6, textcoords="offset points", xytext=(3, 4))
    ax2.axhline(budget_s / 60, color="k", ls="--", lw=1)
    ax2.set_ylim(bottom=0)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("GPU nodes (8 x H200)")
    ax2.set_ylabel("simulated step time (min)")
    ax2.set_title("best split per node count", fontsize=10)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
