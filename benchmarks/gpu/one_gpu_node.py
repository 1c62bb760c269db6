"""The one-GPU-node quickstart on a real GPU: ``experiment=one_gpu_node model.path=DIR`` (issue 33).

    python3 -m benchmarks.gpu.one_gpu_node --out DIR [--steps 6] [--size small]
    python3 -m benchmarks.gpu.one_gpu_node --out DIR --cpu-smoke     # tiny model, CPU, a few steps

What a user does, nothing more: a Hugging Face checkpoint directory (here a seeded
Qwen3MoeForCausalLM built offline by transformers, ``--size small`` ~0.35B, with a byte-level
tokenizer and chat template: benchmarks/gpu/hf_checkpoints.py), then the real CLI
``python -m launcher experiment=one_gpu_node model.path=DIR`` (trainer + embedded engine + orchestrator
as processes). On a 1-GPU machine the plan shares GPU 0 between the trainer and the engine
(launcher/gpus.py) and publishes weight steps through /dev/shm (launcher/weights_dir.py); the
script checks both from the launcher's output and the run directory: the placement lines, every
step in metrics.jsonl, the steps back in run_dir/weights and /dev/shm given back. The model is
random, so rewards stay near 0: this shows the path runs on a GPU and what a step costs, not learning.

``--cpu-smoke``: the tiny checkpoint with ``CUDA_VISIBLE_DEVICES=""`` (every role on the CPU, float32).
The launcher composes its config with Hydra: on a machine without it, put hydra-core, omegaconf and
antlr4-python3-runtime (pure-Python wheels) on PYTHONPATH, as benchmarks/gpu/device_run.sh does with .gpusite/.
Prints a table and writes ``DIR/one_gpu_node.json`` (plus the run's metrics.jsonl and logs under DIR/run).
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


def command(args: argparse.Namespace, ckpt: Path, run_dir: Path) -> list[str]:
    """The launcher's command line: the preset and the checkpoint; the rest only sizes the run."""
    cmd = [sys.executable, "-m", "launcher", "experiment=one_gpu_node", f"model.path={ckpt}",
           f"trainer.num_steps={args.steps}", f"cluster.runs_root={run_dir.parent}", f"launcher.run_dir={run_dir}"]
    if args.cpu_smoke:  # no GPU: float32 on the CPU, small batches
        cmd += ["inference.device=cpu", "inference.dtype=float32", "trainer.dtype=float32", "trainer.compile=none",
                "trainer.activation_checkpointing=none", "orchestrator.num_prompts_per_step=4",
                "orchestrator.num_samples_per_prompt=4", "orchestrator.max_inflight_rollouts=32"]
    return cmd


def summarise(records: list[dict]) -> dict:
    res: dict = {"steps": len(records)}
    if not records:
        return res
    res["reward_first"], res["reward_last"] = records[0].get("reward_mean"), records[-1].get("reward_mean")
    for key in ("step_time_s", "weight_sync_s", "mismatch_kl", "inference_tokens_per_s"):
        vals = [r[key] for r in records if isinstance(r.get(key), (int, float))]
        if vals:
            res[f"{key}_mean"] = sum(vals) / len(vals)
    if len(records) >= 2:
        res["mean_step_interval_s"] = (records[-1]["time"] - records[0]["time"]) / (len(records) - 1)
    return res


def gpu_memory() -> list[str]:
    """What nvidia-smi says each process holds (sampled during the run); [] without nvidia-smi."""
    try:
        q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [ln.strip() for ln in q.stdout.splitlines() if ln.strip()]


def run(args: argparse.Namespace, out: Path) -> dict:
    from benchmarks.gpu.hf_checkpoints import qwen3_moe_dir

    ckpt = out / "checkpoint"
    if not (ckpt / "config.json").exists():
        t0 = time.monotonic()
        qwen3_moe_dir(ckpt, size="tiny" if args.cpu_smoke else args.size)
        print(f"[one_gpu_node] checkpoint {ckpt} built in {time.monotonic() - t0:.1f}s", flush=True)
    run_dir = out / "run"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cmd = command(args, ckpt, run_dir)
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if args.cpu_smoke else {})}
    print(f"[one_gpu_node] {' '.join(cmd[1:])}", flush=True)
    t0, apps = time.monotonic(), set()
    with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        deadline = t0 + args.timeout_s
        while proc.poll() is None and time.monotonic() < deadline:
            if not args.cpu_smoke:
                apps.update(gpu_memory())
            time.sleep(2.0)
        if proc.poll() is None:
            proc.terminate()  # the launcher stops its children in order (SIGTERM, grace, SIGKILL)
        stdout, _ = proc.communicate()
    wall = time.monotonic() - t0
    mpath = run_dir / "metrics.jsonl"
    records = [json.loads(ln) for ln in mpath.read_text().splitlines() if ln.strip()] if mpath.exists() else []
    said = [ln.strip() for ln in stdout.splitlines() if "[slurmrl]   GPU" in ln or "[slurmrl]   weights:" in ln]
    weights = run_dir / "weights"
    linked_to = next((ln.split("published steps in ", 1)[1].split(",", 1)[0] for ln in said if "linked as" in ln), "")
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(cmd[1:]), "returncode": proc.returncode,
           "wall_s": wall, **summarise(records), "plan": said, "gpu_apps": sorted(apps),
           "weights_back_in_run_dir": weights.is_dir() and not weights.is_symlink()
           and any(p.name.startswith("step_") for p in weights.iterdir()),
           "shm_given_back": bool(linked_to) and not Path(linked_to).exists(), "weights_linked_to": linked_to}
    if proc.returncode != 0:
        res["output_tail"] = stdout[-4000:]
    for big in (weights, run_dir / "checkpoints", ckpt):  # GBs: only metrics, logs and configs come back from $OUT
        shutil.rmtree(big, ignore_errors=True)
    return res


def verdict(res: dict, args: argparse.Namespace) -> list[str]:
    """What must hold for the quickstart to count as working here (empty: all of it)."""
    bad = []
    if res["returncode"] != 0 or res["steps"] != args.steps:
        bad.append(f"rc {res['returncode']}, {res['steps']}/{args.steps} steps")
    if not res["weights_back_in_run_dir"]:
        bad.append("run_dir/weights holds no step after the run")
    if not args.cpu_smoke:
        if not any("ONE GPU (0) shared by every role" in ln or "one GPU set per process" in ln for ln in res["plan"]):
            bad.append("the plan printed no GPU placement")
        if not res["shm_given_back"]:
            bad.append("weight steps did not go through /dev/shm and back")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for one_gpu_node.json, the checkpoint and the run")
    ap.add_argument("--steps", type=int, default=None, help="trainer steps (6; --cpu-smoke: 2)")
    ap.add_argument("--size", default="small", choices=("small", "tiny"), help="checkpoint size on CUDA")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny checkpoint, every role on the CPU")
    ap.add_argument("--timeout-s", type=float, default=420.0, help="the run is stopped (and measured) after this")
    args = ap.parse_args(argv)
    args.steps = args.steps or (2 if args.cpu_smoke else 6)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    res = run(args, out)
    res["problems"] = verdict(res, args)
    (out / "one_gpu_node.json").write_text(json.dumps(res, indent=1))
    nan = float("nan")
    print(f"{'steps':>5} {'wall_s':>7} {'step_s':>7} {'interval_s':>10} {'sync_s':>7} {'mismatch_kl':>11} "
          f"{'reward first->last':>20}")
    print(f"{res['steps']:>5d} {res['wall_s']:>7.1f} {res.get('step_time_s_mean', nan):>7.2f} "
          f"{res.get('mean_step_interval_s', nan):>10.2f} {res.get('weight_sync_s_mean', nan):>7.2f} "
          f"{res.get('mismatch_kl_mean', nan):>11.4f} "
          f"{res.get('reward_first') or 0:>9.3f} -> {res.get('reward_last') or 0:.3f}")
    for line in res["plan"] + [f"gpu app: {a}" for a in res["gpu_apps"]]:
        print(f"  {line}")
    for p in res["problems"]:
        print(f"  PROBLEM: {p}")
    if res["returncode"] != 0:
        print(res.get("output_tail", ""))
    print(f"[one_gpu_node] wrote {out / 'one_gpu_node.json'}")
    return 0 if not res["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
