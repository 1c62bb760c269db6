"""One training step of the 1.5B MoE on a single 131,072-token row: peak GPU memory and tokens/s.

    python3 -m benchmarks.gpu.long_context_step --out DIR [--seq-len 131072] [--ac full] [--iters 2]

What runs is the trainer role's step (workers/trainer/step.py ``train_step``) on the model the role
builds (GPU_MOE of benchmarks/gpu/common.py: Qwen3-30B-A3B's layer shape, 8 layers, 32 experts
top-4, vocab 32768), as bench_trainer_step.py builds it: float32 master weights, bf16 compute,
the FSDP2 plan at world 1, AdamW. For the long row: ``trainer.pack_sequences=true`` (attention
per document: torch's varlen flash attention where this torch has it, else causal SDPA per
document; no [T, T] mask), log-probs scored ``trainer.logprob_chunk_tokens`` positions at a time
(no [T, V] logits), Router Replay on, activation checkpointing ``--ac`` (full by default), cp = 1.
Inference log-probs are zeros with the ratio mask opened wide (the memory and time of a step do
not depend on them).

Writes ``DIR/long_context.json`` (``--out``, else $OUT, else benchmarks/out/gpu/; record with split_results or a copy into benchmarks/results/gpu/) in the CPU
benchmark's row format, ``{"runs": [{"seq_len": T, "cp": 1, "peak_bytes_per_rank": P}], ...}``, plus
tokens/s, step times and the device. Imports no Hydra (the dataclasses are the config).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.gpu.bench_trainer_step import synthetic_batch, trainer_model, world_of_one
from benchmarks.gpu.common import GPU_MOE, TINY_MOE, device_info, param_counts, write_result
from workers.common.config import RunConfig, TrainerConfig
from workers.models.blocks import varlen
from workers.trainer.loop import initial_model
from workers.trainer.step import train_step

RESULT_NAME = "long_context"


def run_config(args: argparse.Namespace) -> RunConfig:
    base = TINY_MOE if args.tiny else GPU_MOE
    model = dataclasses.replace(base, name="long_context", max_position_embeddings=max(args.seq_len,
                                                                                      base.max_position_embeddings))
    trainer = TrainerConfig(dtype=args.dtype, master_dtype="float32", activation_checkpointing=args.ac,
                            router_replay=True, pack_sequences=True, logprob_chunk_tokens=args.chunk, lr=1e-5,
                            ratio_mask_low=1e-9, ratio_mask_high=1e9)
    return RunConfig(experiment="long_context_step", model=model, trainer=trainer)


def run(args: argparse.Namespace) -> dict:
    cfg = run_config(args)
    dims = world_of_one()
    try:
        device = dims.device
        model, optimizer = trainer_model(cfg, dims, init="device" if device.type == "cuda" else "step0",
                                         cpu_init=None if device.type == "cuda" else initial_model(cfg))
        batch = synthetic_batch(cfg.model, 1, args.seq_len, seed=args.seed).to(device)
        times, stats = [], {}
        for i in range(args.warmup + args.iters):
            if i == args.warmup and device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            stats = train_step(model, optimizer, batch, cfg.trainer, dims)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
    finally:
        dims.destroy()
    step_s = sorted(times)[len(times) // 2]
    row = {"seq_len": args.seq_len, "cp": 1, "peak_bytes_per_rank": peak}
    print(f"seq_len {args.seq_len}  cp 1  ac {args.ac}  peak {None if peak is None else round(peak / 2**30, 2)} GiB "
          f"(reserved {None if reserved is None else round(reserved / 2**30, 2)} GiB)  step {step_s:.2f} s  "
          f"{args.seq_len / step_s:,.0f} tok/s  loss {stats.get('loss')}", flush=True)
    return {"runs": [row], "tokens_per_s": args.seq_len / step_s, "step_s": times, "peak_reserved_bytes": reserved,
            "activation_checkpointing": args.ac, "logprob_chunk_tokens": args.chunk, "dtype": args.dtype,
            "master_dtype": "float32", "plan": "workers.trainer.parallel.fsdp:parallelize (world 1)",
            "attention": "varlen_attn" if varlen._varlen_fn() is not None else "causal SDPA per document",
            "model": dataclasses.asdict(cfg.model), "params": param_counts(cfg.model),
            "last_step_stats": {k: stats.get(k) for k in ("loss", "pg_loss", "aux_loss", "grad_norm", "num_loss_tokens")}}


def step_arguments(ap: argparse.ArgumentParser, *, tiny_help: str) -> argparse.ArgumentParser:
    """The options of one long-context training step (this script's and long_context_mesh.py's)."""
    ap.add_argument("--seq-len", type=int, default=131072)
    ap.add_argument("--ac", default="full", choices=("none", "full", "selective"))
    ap.add_argument("--chunk", type=int, default=TrainerConfig().logprob_chunk_tokens, help="trainer.logprob_chunk_tokens")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help=tiny_help)
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/out/gpu/", help="directory for the JSON")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    return step_arguments(ap, tiny_help="TINY_MOE (a CPU check of the script, seconds at --seq-len 2048)").parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    result = {"device_info": device_info(), "argv": sys.argv[1:] if argv is None else list(argv)}
    result.update(run(args))
    print(f"wrote {write_result(Path(args.out), RESULT_NAME, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
