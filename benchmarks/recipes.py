"""Evidence that the RL recipes learn: each ``algorithm=`` on the same model, task and seed, then a
distillation of the student from a stronger teacher of the same size.

    python -m benchmarks.recipes [--steps 30] [--distill-steps 20] [--record] [ARGS: extra Hydra overrides]

The model is SmolLM2-135M-Instruct on its word-reversal task (experiment=smollm2_reverse_text) when
its checkpoint package is installed (make install-pretrained), else the tiny dense model
(model=tiny_dense, a Llama-shaped decoder) on reverse_digits (experiment=tiny_local). Every run is
the real CLI (``python -m launcher``: trainer, inference workers and orchestrator as processes,
async with the experiment's staleness window) with the same seed, so step 0 and the prompt stream
are the same for every recipe. Measured from each run's metrics.jsonl:

  1. reward per step per recipe (grpo, dapo, dr_grpo, gspo, cispo): printed as a table of the
     first/last ``--window`` steps' mean reward, and plotted;
  2. distillation: the GRPO run's last published weights (an HF directory: config.json and
     safetensors) are the teacher; a fresh student (the same step 0) trains with
     ``algorithm=on_policy_distill`` and no task reward, and the teacher's reverse KL
     (``teacher_reverse_kl``) falls while the task reward rises toward the teacher's.

Writes recipes.json and recipes_reward.png to benchmarks/out/ (ignored), or to the tracked
benchmarks/results/ with ``--record``.
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
RECIPES = ("grpo", "dapo", "dr_grpo", "gspo", "cispo")
TINY = ["experiment=tiny_local", "model=tiny_dense", "orchestrator.num_prompts_per_step=8",
        "orchestrator.num_samples_per_prompt=8", "orchestrator.max_inflight_rollouts=64", "trainer.num_threads=1"]
SMOLLM2 = ["experiment=smollm2_reverse_text"]
TINY_RECIPE = {"dapo": ["orchestrator.overlong_buffer_frac=0"]}
"""Per-recipe overrides on the tiny task, and why: reverse_digits may generate max_digits + 1 tokens, exactly the
longest correct answer (4 digits and the stop token), so DAPO's overlong ramp would punish right answers (a run
with it measured reward 0.03 -> 0.05 in 50 steps while answers shrank from 4.3 to 1.9 tokens)."""


def smollm2_installed() -> bool:
    """SmolLM2-135M's checkpoint package is installed (the launcher converts it on first use)."""
    from workers.models.pretrained import PretrainedMissing, find_gguf

    try:
        find_gguf("smollm2_135m")
        return True
    except PretrainedMissing:
        return False


def run(name: str, base: list[str], steps: int, root: Path, extra: list[str]) -> dict:
    """One real run; its per-step records (metrics.jsonl) and wall time."""
    run_dir = root / name
    cmd = [sys.executable, "-m", "launcher", *base, f"cluster.runs_root={root}", f"launcher.run_dir={run_dir}",
           f"trainer.num_steps={steps}", "seed=0", *extra]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name}: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-2000:]}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"run_dir": str(run_dir), "wall_s": round(wall, 1), "command": " ".join(cmd[2:]), "records": recs}


def last_weights(run_dir: str, out: Path) -> Path:
    """The run's last published step as a self-contained Hugging Face directory (a delta step resolved)."""
    steps = sorted(p for p in (Path(run_dir) / "weights").glob("step_*") if (p / "STABLE").exists())
    subprocess.run([sys.executable, "-m", "workers.weights.filesystem.resolve", str(steps[-1]), str(out)], cwd=REPO,
                   check=True, capture_output=True)
    return out


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summarise(name: str, result: dict, window: int) -> dict:
    rewards = [r["reward_mean"] for r in result["records"]]
    row = {"recipe": name, "steps": len(rewards), f"reward_first{window}": round(mean(rewards[:window]), 4),
           f"reward_last{window}": round(mean(rewards[-window:]), 4), "wall_s": result["wall_s"],
           "reward_per_step": [round(x, 4) for x in rewards],
           "clip_frac_mean": round(mean([r.get("clip_frac", 0.0) for r in result["records"]]), 4),
           "command": result["command"]}
    if "teacher_reverse_kl" in result["records"][0]:
        kl = [r["teacher_reverse_kl"] for r in result["records"]]
        row.update({"teacher_reverse_kl_per_step": [round(x, 4) for x in kl],
                    f"teacher_reverse_kl_first{window}": round(mean(kl[:window]), 4),
                    f"teacher_reverse_kl_last{window}": round(mean(kl[-window:]), 4)})
    return row


def plot(rows: list[dict], distill: dict | None, teacher_reward: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if distill else 1, figsize=(12 if distill else 7, 4.2), squeeze=False)
    ax = axes[0][0]
    for row in rows:
        ax.plot(range(1, row["steps"] + 1), row["reward_per_step"], "-", lw=1.5, label=row["recipe"])
    ax.set_xlabel("trainer step")
    ax.set_ylabel("mean reward of the step's samples")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if distill:
        ax = axes[0][1]
        steps = range(1, distill["steps"] + 1)
        ax.plot(steps, distill["teacher_reverse_kl_per_step"], "-", c="tab:red", label="reverse KL to the teacher")
        ax.set_xlabel("trainer step")
        ax.set_ylabel("KL(student || teacher) per token", color="tab:red")
        twin = ax.twinx()
        twin.plot(steps, distill["reward_per_step"], "-", c="tab:blue", label="task reward (not trained on)")
        twin.axhline(teacher_reward, ls="--", c="tab:blue", alpha=0.5, label="teacher's last reward")
        twin.set_ylabel("task reward", color="tab:blue")
        ax.set_title("on-policy distillation from the GRPO run's last weights", fontsize=9)
        twin.legend(fontsize=8, loc="center right")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30, help="trainer steps per recipe")
    p.add_argument("--distill-steps", type=int, default=20, help="trainer steps of the distilled student (0: skip)")
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated algorithm names")
    p.add_argument("--window", type=int, default=5, help="steps averaged at each end of a curve")
    p.add_argument("--tiny", action="store_true", help="the tiny model even where SmolLM2 is installed")
    p.add_argument("--root", default="", help="runs root (default: a temporary directory)")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = p.parse_args(argv)
    out = results_dir()  # benchmarks/out/, or with --record the tracked benchmarks/results/ (benchmarks/record.py)
    smollm2 = not args.tiny and smollm2_installed()
    base, model = (SMOLLM2, "SmolLM2-135M-Instruct, reverse_text") if smollm2 else (TINY, "tiny_dense, reverse_digits")
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="recipes-"))
    rows, results = [], {}
    print(f"model: {model}; {args.steps} steps per recipe; runs under {root}", flush=True)
    for name in args.recipes.split(","):
        extra = [] if smollm2 else TINY_RECIPE.get(name, [])
        results[name] = run(name, base, args.steps, root, [f"algorithm={name}", *extra, *args.overrides])
        rows.append(summarise(name, results[name], args.window))
        r = rows[-1]
        print(f"{name:10s} reward first{args.window} {r[f'reward_first{args.window}']:.3f} -> last{args.window} "
              f"{r[f'reward_last{args.window}']:.3f}  clip_frac {r['clip_frac_mean']:.3f}  ({r['wall_s']:.0f} s)",
              flush=True)
    distill, teacher_reward = None, float("nan")
    if args.distill_steps and "grpo" in results:
        teacher = last_weights(results["grpo"]["run_dir"], root / "teacher")
        teacher_reward = rows[[r["recipe"] for r in rows].index("grpo")][f"reward_last{args.window}"]
        res = run("on_policy_distill", base, args.distill_steps, root,
                  ["algorithm=on_policy_distill", f"algorithm.teacher.path={teacher}", *args.overrides])
        distill = summarise("on_policy_distill", res, args.window)
        distill["teacher"] = str(teacher)
        w = args.window
        print(f"distill    reverse KL first{w} {distill[f'teacher_reverse_kl_first{w}']:.3f} -> last{w} "
              f"{distill[f'teacher_reverse_kl_last{w}']:.3f}; task reward {distill[f'reward_first{w}']:.3f} -> "
              f"{distill[f'reward_last{w}']:.3f} (teacher {teacher_reward:.3f}; {distill['wall_s']:.0f} s)", flush=True)
    print("\nreward per step:")
    for r in rows + ([distill] if distill else []):
        print(f"  {r['recipe']:18s} " + " ".join(f"{x:.2f}" for x in r["reward_per_step"]))
    png = out / "recipes_reward.png"
    plot(rows, distill, teacher_reward, png, f"{model}, same seed, {args.steps} steps each")
    (out / "recipes.json").write_text(json.dumps({
        "model": model, "steps": args.steps, "window": args.window, "date": time.strftime("%Y-%m-%d"),
        "device": "CPU (this machine)", "recipes": rows, "distillation": distill}, indent=1))
    print(f"wrote {out / 'recipes.json'} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
