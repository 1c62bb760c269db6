"""Every GPU measurement of issue 11 in one process: ``python -m benchmarks.gpu.run_all --out DIR``.

Sections (each fails alone, recorded as ``{"error": ...}``; the JSON is rewritten after
each one, so a run cut short still returns what it measured):
  trainer         step tokens/s and MFU, dense and MoE, packed 4k and 16k sequences
  trainer_step    the REAL trainer step (FSDP2 plan, fp32 master, train_step) vs the direct one, 4 x 4096
  inference       embedded engine vs transformers generate, 64 prompts x 512 new tokens
  weight_sync     filesystem transport vs disk, /dev/shm, pinned and pageable staging
  router_replay   mismatch KL without / with Router Replay, bf16 and fp8 inference
  smoke_loop      ``python -m launcher`` (all roles as processes, inference + trainer on the GPU)
  trainer_compiled  torch.compile'd model at 4k (only if the time budget allows)
``--tiny`` runs all of it on CPU with tiny shapes (a check before spending GPU time).
Writes ``DIR/gpu_results.json`` (all sections, with device and date) and prints a summary table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.gpu.common import device_info, free_cuda

SECTIONS = ("trainer", "trainer_step", "inference", "weight_sync", "router_replay", "smoke_loop", "trainer_compiled")
OPTIONAL = {"trainer_compiled"}


def smoke_loop(args: argparse.Namespace, device: torch.device) -> dict:
    """The full loop for a few steps through the real launcher (Hydra carried as wheels)."""
    runs_root = Path(args.scratch).resolve() / "smoke_runs"
    steps = 3 if args.tiny else args.smoke_steps
    inf_dev = "cuda" if device.type == "cuda" else "cpu"
    cmd = [sys.executable, "-m", "launcher", "experiment=tiny_local", f"trainer.num_steps={steps}",
           f"inference.device={inf_dev}", "inference.dtype=bfloat16" if inf_dev == "cuda" else "inference.dtype=float32",
           f"cluster.runs_root={runs_root}"]
    t0 = time.perf_counter()
    gpu_apps: set[str] = set()  # which processes hold GPU memory while the loop runs
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        deadline = time.monotonic() + args.smoke_timeout_s
        while proc.poll() is None and time.monotonic() < deadline and device.type == "cuda":
            q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30)
            gpu_apps.update(ln.strip() for ln in q.stdout.splitlines() if ln.strip())
            time.sleep(2.0)
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
    p = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    wall = time.perf_counter() - t0
    run_dir = (runs_root / "latest").resolve()
    records = []
    mpath = run_dir / "metrics.jsonl"
    if mpath.exists():
        records = [json.loads(line) for line in mpath.read_text().splitlines() if line.strip()]
    logs = {}
    for f in sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").is_dir() else []:
        text = f.read_text()
        logs[f.name] = text[:1500] + ("\n...\n" + text[-1500:] if len(text) > 3000 else text[1500:])
    keep = ("step", "reward_mean", "max_staleness", "mismatch_kl", "tokens_per_s", "step_time_s", "weight_sync_s",
            "trainer_idle_frac")
    res = {"command": " ".join(cmd[1:]), "returncode": p.returncode, "wall_s": wall, "num_steps_logged": len(records),
           "steps": [{k: r.get(k) for k in keep} for r in records], "stdout_tail": p.stdout[-3000:],
           "stderr_tail": p.stderr[-3000:], "role_logs_tail": logs,
           "trainer_on": next((ln for ln in logs.get("trainer_0.log", "").splitlines() if "nccl" in ln or "gloo" in ln), None),
           "gpu_processes_seen": sorted(gpu_apps)}
    if records:
        res["reward_first"] = records[0].get("reward_mean")
        res["reward_last"] = records[-1].get("reward_mean")
    print(f"  smoke loop: rc {p.returncode}, {len(records)} steps in {wall:.1f}s, reward "
          f"{res.get('reward_first')} -> {res.get('reward_last')}", flush=True)
    return res


def trainer_step(args: argparse.Namespace, device: torch.device) -> dict:
    """benchmarks/gpu/bench_trainer_step.py at its defaults (4 x 4096 tokens; tiny: 2 x 64). Imported
    here: the trainer's imports failing must fail this section alone."""
    from benchmarks.gpu import bench_trainer_step

    return bench_trainer_step.run(bench_trainer_step.parse_args((["--tiny"] if args.tiny else [])
                                                                 + ["--iters", str(args.iters)]), device)


def summary_rows(results: dict) -> list[str]:
    rows = []
    tr = results.get("trainer", {})
    for r in tr.get("runs", []):
        rows.append(f"trainer {r['model']:5s} seq {r['seq_len']:>6d}  {r['tokens_per_s']:>10.0f} tok/s  MFU {r['mfu']:.3f}"
                    f"  (causal attn {r['mfu_causal_attention']:.3f})  mem {r.get('peak_memory_gib') or 0:.1f} GiB"
                    f"  sdpa {r.get('causal_sdpa_backends')}")
    for r in results.get("trainer_compiled", {}).get("runs", []):
        rows.append(f"trainer {r['model']:5s} seq {r['seq_len']:>6d}  {r['tokens_per_s']:>10.0f} tok/s  MFU {r['mfu']:.3f} compiled")
    step_runs = results.get("trainer_step", {}).get("runs", [])
    if step_runs:
        from benchmarks.gpu.bench_trainer_step import table_row

        rows.extend("trainer_step " + table_row(r) for r in step_runs)
    inf = results.get("inference", {})
    if "engine" in inf:
        rows.append(f"inference engine {inf['engine']['output_tokens_per_s']:.0f} tok/s, HF generate "
                    f"{inf.get('hf_generate', {}).get('output_tokens_per_s', float('nan')):.0f} tok/s, ratio "
                    f"{inf.get('ratio_engine_over_hf', float('nan')):.2f}; HF with torch's SDPA pick "
                    f"{inf.get('hf_generate_torch_default_sdpa', {}).get('output_tokens_per_s', float('nan')):.0f} tok/s; "
                    f"ratio by prompts {inf.get('ratio_engine_over_hf_by_prompts')}")
    ws = results.get("weight_sync", {})
    for fs in ("disk", "shm"):
        if isinstance(ws.get(fs), dict) and "publish_gbps" in ws[fs]:
            w = ws[fs]
            rows.append(f"weights {fs}: publish {w['publish_gbps']:.2f} GB/s (raw {w['raw']['write_fsync_gbps']:.2f}), "
                        f"load {w['load_step_gbps']:.2f} GB/s (raw {w['raw']['read_gbps']:.2f})")
    rr = results.get("router_replay", {})
    for k, v in rr.items():
        if k.startswith("inference_") and isinstance(v, dict):
            rows.append(f"replay {k}: kl {v['kl_no_replay']:.2e} -> {v['kl_replay']:.2e} reduction {v['reduction']}")
    sm = results.get("smoke_loop", {})
    if sm:
        rows.append(f"smoke loop rc {sm.get('returncode')} steps {sm.get('num_steps_logged')} reward "
                    f"{sm.get('reward_first')} -> {sm.get('reward_last')}")
    for k, v in results.items():
        if isinstance(v, dict) and "error" in v:
            rows.append(f"{k}: ERROR {v['error'][:200]}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/out/gpu/latest", help="directory for gpu_results.json")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (runs on CPU in seconds)")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma list of sections out of {SECTIONS}")
    ap.add_argument("--scratch", default=".gpu_bench_scratch", help="scratch dir on the disk under test")
    ap.add_argument("--tokens-per-step", type=int, default=32768)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--smoke-steps", type=int, default=20)
    ap.add_argument("--smoke-timeout-s", type=float, default=240.0)
    ap.add_argument("--skip-hf-default", action="store_true", help="skip HF generate with torch's default SDPA pick")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip optional sections once this much time is spent")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(args.scratch).mkdir(parents=True, exist_ok=True)
    results: dict = {"device_info": device_info(), "tiny": args.tiny, "argv": sys.argv[1:]}
    t_start = time.perf_counter()
    from benchmarks.gpu import bench_inference, bench_router_replay, bench_trainer, bench_weight_sync

    funcs = {"trainer": bench_trainer.run, "trainer_step": trainer_step, "inference": bench_inference.run, "weight_sync": bench_weight_sync.run,
             "router_replay": bench_router_replay.run, "smoke_loop": smoke_loop,
             "trainer_compiled": bench_trainer.run_compiled}
    for name in [s for s in args.only.split(",") if s]:
        elapsed = time.perf_counter() - t_start
        if name in OPTIONAL and elapsed > args.budget_s:
            results[name] = {"skipped": f"time budget: {elapsed:.0f}s spent > {args.budget_s:.0f}s"}
            continue
        print(f"== {name} ({elapsed:.0f}s so far)", flush=True)
        t0 = time.perf_counter()
        try:
            results[name] = funcs[name](args, device)
        except Exception as e:  # noqa: BLE001 - one section's failure must not lose the others
            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-4000:]}
        results[name]["section_wall_s"] = time.perf_counter() - t0
        free_cuda()
        (out / "gpu_results.json").write_text(json.dumps(results, indent=1, sort_keys=True, default=str))
    results["total_wall_s"] = time.perf_counter() - t_start
    (out / "gpu_results.json").write_text(json.dumps(results, indent=1, sort_keys=True, default=str))
    print("== summary (" + results["device_info"].get("device", "?") + ")")
    for row in summary_rows(results):
        print("  " + row)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    sys.exit(main())
