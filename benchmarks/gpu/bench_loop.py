"""The full local loop on one GPU, dynamic engine vs static engine, side by side (issue 24).

    python -m benchmarks.gpu.bench_loop --out DIR [--steps 20] [--model gpu_moe_1b5]
    python -m benchmarks.gpu.bench_loop --out DIR --cpu-smoke      # a few tiny steps on CPU
    python -m benchmarks.gpu.bench_loop --out DIR --compare delta --make-checkpoint DIR/ckpt
                                  # dense vs sparse-patch weight updates (issue 31), model.path= a
                                  # transformers-built 0.73B Qwen3-MoE (48 experts, top-8)

Runs the SAME job twice through the real CLI (``python -m launcher experiment=tiny_local``:
trainer + 2 embedded engines as processes, real HTTP, real weight publishing), once with
``inference.static_cache=off`` (before: the dynamic KV cache, host-bound on a GPU) and once with
``auto`` (after: fixed KV slots + CUDA-graph decode on a GPU). Same model, seed and steps, so
the difference is the engine. On CUDA the model is a preset bigger than tiny (default
``gpu_moe_1b5``: 1.5B MoE, bf16 trainer and engines) so generation is real work; the engines'
positions per slot are capped (``--max-seq-len``) so two static caches and the trainer share one GPU.

``--cpu-smoke`` (no GPU needed): the tiny model, a few steps, engines on CPU, the "after" run
with ``static_cache=on`` (``auto`` is the dynamic engine on CPU) so both engines really run.

Prints a table (steps, wall s, mean step time s, rollout tok/s, the engines' own tok/s, inference
busy fraction, weight sync s, reward first -> last) and writes ``DIR/loop.json``. Mean step time
is the interval between consecutive trainer steps (steps 2..N: step 1 waits for process start-up
and the first rollouts), the rate the loop runs at; rollout tok/s is generated completion tokens
over the same interval. The loop is asynchronous (rollouts overlap training), so the step time
is the slower of generation and training + weight publishing (~3 GB per step at 1.5B): the env
is reverse_digits with ``--digits`` 128 so generation is a real share of a step. The launcher composes
its config with Hydra: on a machine without it, put hydra-core, omegaconf and antlr4-python3-runtime
(pure-Python wheels) on PYTHONPATH, as benchmarks/gpu/device_run.sh does with .gpusite/.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODES = (("before", "off"), ("after", "auto"))
DELTA_MODES = (("dense", "false"), ("delta", "true"))
QWEN3_MOE_0B7 = dict(vocab_size=32768, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256,
                     num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=48,
                     num_experts_per_tok=8, max_position_embeddings=4096, norm_topk_prob=True, tie_word_embeddings=False)
"""The ``--make-checkpoint`` model: ~0.73B parameters, expert count and top-k of the Qwen3-MoE family."""


def make_checkpoint(directory: Path) -> Path:
    """Save a seeded transformers Qwen3-MoE (bf16) into ``directory``, as a user's checkpoint looks."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    if (directory / "config.json").is_file():
        return directory
    torch.manual_seed(0)
    config = Qwen3MoeConfig(**QWEN3_MOE_0B7)
    config.architectures = ["Qwen3MoeForCausalLM"]
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    print(f"[bench_loop] wrote {directory}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params", flush=True)
    return directory


def overrides(args: argparse.Namespace, mode: str, run_dir: Path) -> list[str]:
    """The launcher's command line of one run (``mode``: inference.static_cache, or with ``--compare
    delta`` weights.delta)."""
    cache = "auto" if args.compare == "delta" and not args.cpu_smoke else "on" if args.compare == "delta" else mode
    common = ["experiment=tiny_local", f"trainer.num_steps={args.steps}", f"seed={args.seed}",
              f"cluster.runs_root={run_dir.parent}", f"launcher.run_dir={run_dir}",
              f"inference.static_cache={cache}", f"inference.max_seq_len={args.max_seq_len}"]
    if args.compare == "delta":
        # a random model earns ~no reward here: the MoE balance loss keeps the update non-zero (AdamW
        # then moves every weight by ~lr, as a rewarded RL step does)
        common += [f"weights.delta={mode}", f"trainer.lr={args.lr}", "trainer.aux_loss_coef=0.01"]
    if args.digits:  # reverse N digits: a prompt of ~N tokens, a completion of up to N + 1
        common += [f"env.min_digits={args.digits}", f"env.max_digits={args.digits}"]
    if args.cpu_smoke:
        return common + ["inference.device=cpu", "inference.dtype=float32"]
    model = [f"model.path={args.model_path}"] if args.model_path else [f"model={args.model}"]
    return common + model + ["inference.device=cuda", "inference.dtype=bfloat16",
                             "trainer.dtype=bfloat16", f"trainer.micro_batch_tokens={args.micro_batch_tokens}"]


def engine_lines(run_dir: Path) -> list[str]:
    """What each engine said it is (the static engine logs its slots; the factory its fallbacks)."""
    out = []
    for f in sorted((run_dir / "logs").glob("inference_*.log")) if (run_dir / "logs").is_dir() else []:
        out += [f"{f.stem}: {ln.strip()[:300]}" for ln in f.read_text(errors="replace").splitlines()
                if "static engine:" in ln or "static KV cache unavailable" in ln or "CUDA graph" in ln][:4]
    return out


def summarise(records: list[dict]) -> dict:
    """Loop rate from metrics.jsonl: step-to-step interval and generated tokens over steps 2..N."""
    res: dict = {"steps": len(records)}
    if not records:
        return res
    res["reward_first"], res["reward_last"] = records[0].get("reward_mean"), records[-1].get("reward_mean")
    warm = records[1:] or records  # step 1 holds the compile and warm-up (40 s on the H200): not a step's cost
    res["trainer_busy_s_mean"] = sum(r["step_time_s"] for r in warm) / len(warm)
    for key in ("inference_busy_frac", "inference_tokens_per_s", "weight_sync_s", "completion_len_mean",
                "weight_bytes", "weight_changed_frac"):
        res[f"{key}_mean"] = sum(r.get(key) or 0.0 for r in records) / len(records)
    # what training waited for: the whole publish when dense, the diff alone with patches (issue 31)
    blocked = [r["weight_blocked_s"] if r.get("weight_blocked_s") is not None else r.get("weight_sync_s", 0.0)
               for r in warm]
    res["weight_blocked_s_mean"] = sum(blocked) / len(blocked)
    # of the trainer's busy time (load .. publish), and of its whole step (busy + waiting for rollouts)
    res["weight_blocked_frac_of_step"] = res["weight_blocked_s_mean"] / max(res["trainer_busy_s_mean"], 1e-9)
    patches = [r for r in records if r.get("weight_published_changed_frac") is not None]
    if patches:  # the background publish of the step before each record, when it was a patch
        ratios = sorted(r["weight_published_bytes"] / r["weight_published_dense_bytes"] for r in patches)
        res["bytes_ratio_delta_over_dense"] = ratios[len(ratios) // 2]
        res["changed_frac_median"] = sorted(r["weight_published_changed_frac"] for r in patches)[len(patches) // 2]
    if len(records) >= 2:
        span = records[-1]["time"] - records[0]["time"]
        toks = sum(r.get("num_samples", 0) * r.get("completion_len_mean", 0.0) for r in records[1:])
        res["mean_step_time_s"] = span / (len(records) - 1)
        res["weight_blocked_frac_of_interval"] = res["weight_blocked_s_mean"] / max(res["mean_step_time_s"], 1e-9)
        res["rollout_tok_per_s"] = toks / max(span, 1e-9)
    return res


def run_once(name: str, cache: str, args: argparse.Namespace, root: Path, keep: Path) -> dict:
    """(``cache``: the mode of this run: inference.static_cache, or weights.delta with --compare delta)"""
    """One launcher run in ``root/name``; its metrics and logs are copied to ``keep/name`` and the
    run directory (published weights: GBs per step for a 1.5B model) is removed when ``root`` is
    not ``keep``."""
    run_dir = root / name
    cmd = [sys.executable, "-m", "launcher", *overrides(args, cache, run_dir)]
    print(f"[bench_loop] {name}: {' '.join(cmd[2:])}", flush=True)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout_s)
        rc, tail = proc.returncode, (proc.stdout[-2000:] + proc.stderr[-2000:])
    except subprocess.TimeoutExpired as e:  # what it logged so far is still measured
        rc, tail = 124, f"timed out after {args.timeout_s}s: {str(e.stdout or '')[-1500:]}"
    wall = time.monotonic() - t0
    mpath = run_dir / "metrics.jsonl"
    records = [json.loads(ln) for ln in mpath.read_text().splitlines() if ln.strip()] if mpath.exists() else []
    res = {"name": name, "static_cache": cache, "command": " ".join(cmd[1:]), "returncode": rc, "wall_s": wall,
           **summarise(records), "engines": engine_lines(run_dir)}
    if root != keep and run_dir.is_dir():
        (keep / name).mkdir(parents=True, exist_ok=True)
        if mpath.exists():
            shutil.copy2(mpath, keep / name / "metrics.jsonl")
        if (run_dir / "logs").is_dir():
            shutil.copytree(run_dir / "logs", keep / name / "logs", dirs_exist_ok=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    if rc != 0:
        res["output_tail"] = tail
    return res


def table(rows: list[dict]) -> str:
    head = (f"{'run':<7} {'mode':<5} {'steps':>5} {'wall_s':>8} {'step_s':>8} {'rollout_tok/s':>13} {'engine_tok/s':>12} "
            f"{'infer_busy':>10} {'sync_s':>6} {'blocked_s':>9} {'reward first->last':>20}")
    lines = [head, "-" * len(head)]
    for r in rows:
        rew = f"{r.get('reward_first', float('nan')):.3f} -> {r.get('reward_last', float('nan')):.3f}"
        lines.append(f"{r['name']:<7} {r['static_cache']:<5} {r['steps']:>5d} {r['wall_s']:>8.1f} "
                     f"{r.get('mean_step_time_s', float('nan')):>8.2f} {r.get('rollout_tok_per_s', float('nan')):>13.0f} "
                     f"{r.get('inference_tokens_per_s_mean', float('nan')):>12.0f} "
                     f"{r.get('inference_busy_frac_mean', float('nan')):>10.2f} {r.get('weight_sync_s_mean', float('nan')):>6.2f} "
                     f"{r.get('weight_blocked_s_mean', float('nan')):>9.3f} {rew:>20}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for loop.json (and the two run directories)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU, a few steps")
    ap.add_argument("--steps", type=int, default=None, help="trainer steps per run (20; --cpu-smoke: 3)")
    ap.add_argument("--model", default="gpu_moe_1b5", help="hydra_conf/model preset used on CUDA")
    ap.add_argument("--max-seq-len", type=int, default=None,
                    help="inference.max_seq_len: positions per engine slot (1024; --cpu-smoke: 0 = the model's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare", choices=("engine", "delta"), default="engine",
                    help="engine: dynamic vs static engine; delta: dense vs sparse-patch weight updates (issue 31)")
    ap.add_argument("--model-path", default=None, help="model.path= a HF checkpoint (instead of --model)")
    ap.add_argument("--make-checkpoint", default=None,
                    help="build the 0.73B Qwen3-MoE checkpoint with transformers here (if absent) and use it")
    ap.add_argument("--lr", type=float, default=1e-6, help="trainer.lr with --compare delta (an RL learning rate)")
    ap.add_argument("--digits", type=int, default=None,
                    help="env.min_digits = env.max_digits: completion length ~ digits + 1 (128; --cpu-smoke: the "
                         "experiment's 2..4). Long enough that generation, not the 3 GB weight publish, can set the pace")
    ap.add_argument("--micro-batch-tokens", type=int, default=16384, help="trainer.micro_batch_tokens on CUDA")
    ap.add_argument("--runs-root", default=None,
                    help="where the runs (and their published weights) live: /dev/shm/slurmrl_bench_loop on CUDA "
                         "when /dev/shm exists (the H200's disk writes 0.28 GB/s), else DIR/runs")
    ap.add_argument("--timeout-s", type=float, default=280.0,
                    help="per run (both runs fit a 10-minute device call; a run cut short is still measured)")
    args = ap.parse_args(argv)
    args.steps = args.steps or (3 if args.cpu_smoke else 20)
    args.digits = args.digits if args.digits is not None else (0 if args.cpu_smoke else 128)
    args.max_seq_len = args.max_seq_len if args.max_seq_len is not None else (0 if args.cpu_smoke else 1024)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.make_checkpoint:
        args.model_path = str(make_checkpoint(Path(args.make_checkpoint).resolve()))
    modes = DELTA_MODES if args.compare == "delta" else (("before", "off"), ("after", "on")) if args.cpu_smoke else MODES
    shm = not args.cpu_smoke and os.path.isdir("/dev/shm")
    root = Path(args.runs_root or ("/dev/shm/slurmrl_bench_loop" if shm else out / "runs")).resolve()
    rows = []
    for name, cache in modes:  # one after the other: both share the one GPU
        rows.append(run_once(name, cache, args, root, out / "runs"))
        (out / "loop.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args),
                                                   "runs": rows}, indent=1))
    before, after = rows
    if before.get("mean_step_time_s") and after.get("mean_step_time_s"):
        ratio = before["mean_step_time_s"] / after["mean_step_time_s"]
        result = json.loads((out / "loop.json").read_text()) | {"step_time_before_over_after": ratio}
        if args.compare == "delta":
            result["blocked_s_dense_over_delta"] = before["weight_blocked_s_mean"] / max(after["weight_blocked_s_mean"], 1e-9)
        (out / "loop.json").write_text(json.dumps(result, indent=1))
    print(table(rows))
    for r in rows:
        for line in r["engines"]:
            print(f"  {r['name']}: {line}")
        if r["returncode"] != 0:
            print(f"  {r['name']} FAILED (rc {r['returncode']}):\n{r.get('output_tail', '')}")
    print(f"[bench_loop] wrote {out / 'loop.json'}")
    return 0 if all(r["returncode"] == 0 and r["steps"] == args.steps for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
