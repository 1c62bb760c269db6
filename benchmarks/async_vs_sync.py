"""Async vs sync under heavy-tailed env latency: the reason slurmrl exists, measured.

    python -m benchmarks.async_vs_sync [--steps 60] [--latency lognormal] [--median 0.2] [--ratio 20]

Runs the SAME local job twice in one invocation, through the real CLI (all roles as
processes, real HTTP, real training): ``orchestrator.max_off_policy_steps=0`` (synchronous:
every batch waits for its slowest episode) and ``=2`` (asynchronous). Each episode waits a
simulated env-step latency drawn from a heavy-tailed law (workers/orchestrator/envs/latency.py,
p99 = ``--ratio`` x median). ``--trainer-delay`` emulates a trainer step of a large model
(on this CPU a tiny-model step takes ~0.2 s, far less than any real trainer). The async run
also starts ``--spare`` extra groups (orchestrator.num_spare_groups), so batches take the
groups that finish first; the sync baseline is the classic one (no spares).

Prints wall time, trainer_idle_frac, inference utilisation, samples dropped, final reward and
``speedup = wall_sync / wall_async``; writes benchmarks/out/async_vs_sync.json and two
PNGs (reward vs wall time; utilisation timeline per role).
``--record`` writes into the tracked benchmarks/results/ instead (benchmarks/record.py).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from benchmarks.record import results_dir

REPO = Path(__file__).resolve().parents[1]
RESULTS = results_dir()


def run_once(name: str, max_off: int, args, root: Path) -> dict:
    run_dir = root / name
    overrides = [
        f"cluster.runs_root={root}", f"launcher.run_dir={run_dir}", f"trainer.num_steps={args.steps}",
        f"orchestrator.max_off_policy_steps={max_off}", f"orchestrator.num_prompts_per_step={args.prompts}",
        f"orchestrator.num_samples_per_prompt={args.samples}", f"orchestrator.max_inflight_rollouts={args.inflight}",
        f"env.latency={args.latency}", f"env.latency_median_s={args.median}",
        f"env.latency_p99_over_median={args.ratio}", f"trainer.simulated_step_delay_s={args.trainer_delay}",
        f"seed={args.seed}", f"orchestrator.num_spare_groups={args.spare if max_off > 0 else 0}",
    ]
    print(f"[bench] {name}: max_off_policy_steps={max_off}, {args.steps} steps ...", flush=True)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "launcher", *overrides], cwd=REPO, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    t_start = recs[0]["time"] - recs[0]["step_time_s"] - recs[0]["idle_s"]
    last = recs[-10:]
    return {
        "name": name,
        "max_off_policy_steps": max_off,
        "steps": len(recs),
        "wall_s": wall,
        "train_wall_s": recs[-1]["time"] - t_start,
        # steady state: step 1's wait is process start-up (imports, step-0 weights), not the loop
        "trainer_idle_frac": idle_frac(recs[1:]),
        "trainer_idle_frac_incl_startup": idle_frac(recs),
        "inference_util": sum(r.get("inference_busy_frac", 0.0) for r in recs) / len(recs),
        "samples_dropped": recs[-1].get("samples_dropped_stale_total", 0),
        "max_staleness": max(r["max_staleness"] for r in recs),
        "reward_first10": sum(r["reward_mean"] for r in recs[:10]) / len(recs[:10]),
        "reward_last10": sum(r["reward_mean"] for r in last) / len(last),
        "curve": [{"t": r["time"] - t_start, "reward": r["reward_mean"], "idle_s": r["idle_s"],
                   "step_time_s": r["step_time_s"], "inference_busy": r.get("inference_busy_frac", 0.0)} for r in recs],
    }


def idle_frac(recs: list[dict]) -> float:
    return sum(r["idle_s"] for r in recs) / max(sum(r["idle_s"] + r["step_time_s"] for r in recs), 1e-9)


def table(rows: list[dict]) -> str:
    head = f"{'mode':<6} {'wall_s':>8} {'train_wall_s':>12} {'idle_frac':>9} {'infer_util':>10} {'dropped':>7} " \
           f"{'max_stale':>9} {'reward_end':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['name']:<6} {r['wall_s']:>8.1f} {r['train_wall_s']:>12.1f} {r['trainer_idle_frac']:>9.3f} "
                     f"{r['inference_util']:>10.3f} {r['samples_dropped']:>7d} {r['max_staleness']:>9d} "
                     f"{r['reward_last10']:>10.3f}")
    return "\n".join(lines)


def plot(rows: list[dict], out_dir: Path) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench] matplotlib not installed: no plots (pip install matplotlib)")
        return []
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        ax.plot([c["t"] for c in r["curve"]], [c["reward"] for c in r["curve"]], label=f"{r['name']} (max_off={r['max_off_policy_steps']})")
    ax.set_xlabel("wall time (s)"), ax.set_ylabel("reward_mean"), ax.legend(), ax.set_title("reward vs wall time")
    p1 = out_dir / "async_vs_sync_reward.png"
    fig.tight_layout(), fig.savefig(p1, dpi=110), plt.close(fig)
    fig, axes = plt.subplots(len(rows), 1, figsize=(7, 2.6 * len(rows)), sharex=True)
    for ax, r in zip(axes, rows):
        t = [c["t"] for c in r["curve"]]
        busy = [c["step_time_s"] / max(c["step_time_s"] + c["idle_s"], 1e-9) for c in r["curve"]]
        ax.step(t, busy, where="post", label="trainer busy")
        ax.step(t, [c["inference_busy"] for c in r["curve"]], where="post", label="inference busy")
        ax.set_ylim(-0.05, 1.05), ax.set_ylabel(r["name"]), ax.legend(loc="lower right", fontsize=8)
    axes[-1].set_xlabel("wall time (s)")
    fig.suptitle("utilisation per role (fraction of each step interval)")
    p2 = out_dir / "async_vs_sync_utilization.png"
    fig.tight_layout(), fig.savefig(p2, dpi=110), plt.close(fig)
    return [str(p1.relative_to(REPO)), str(p2.relative_to(REPO))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--latency", default="lognormal", choices=["lognormal", "pareto"])
    ap.add_argument("--median", type=float, default=0.2, help="median env latency per episode (s)")
    ap.add_argument("--ratio", type=float, default=20.0, help="p99 / median of the env latency")
    ap.add_argument("--trainer-delay", type=float, default=0.5, help="emulated extra trainer step time (s)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--inflight", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--spare", type=int, default=16,
                    help="async only: groups started beyond need, so long-tail episodes never hold a batch back")
    ap.add_argument("--out", default=str(RESULTS / "async_vs_sync.json"))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="slurmrl-bench-") as tmp:
        rows = [run_once("sync", 0, args, Path(tmp)), run_once("async", 2, args, Path(tmp))]
    sync, asyn = rows
    speedup = sync["train_wall_s"] / asyn["train_wall_s"]
    print(table(rows))
    print(f"speedup = wall_sync / wall_async = {speedup:.2f}  (target >= 2.77)")
    print(f"async trainer_idle_frac = {asyn['trainer_idle_frac']:.3f}  (target <= 0.05)")
    print(f"reward_end async - sync = {asyn['reward_last10'] - sync['reward_last10']:+.3f}  (target >= -0.05)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    plots = plot(rows, RESULTS)
    result = {"date": time.strftime("%Y-%m-%d"), "args": vars(args), "speedup": speedup, "plots": plots,
              "note": "wall = first batch wait to last step of the trainer (train_wall_s); wall_s includes startup",
              "runs": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"[bench] wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
