"""One 131,072-token training step under the mesh plan with context parallelism (cp x tp x ep) on one node.

    python3 -m benchmarks.gpu.long_context_mesh --out DIR --layouts 1,1,1 1,2,2 4,1,1 4,2,1 4,1,2 2,2,2
    python3 -m benchmarks.gpu.long_context_mesh --tiny --seq-len 256 --world 4 --layouts 1,1,1 2,2,1 2,1,2

Why: the large presets train 131k-token episodes with cp inside the tp/ep mesh plan
(workers/trainer/parallel/mesh.py; Kimi K2 cp 8, Nemotron 3 Ultra cp 16). CPU tests pin the numbers
on gloo with tiny models; this measures what only GPUs can: peak memory per rank and tokens/s of
the real trainer step (workers/trainer/step.py ``train_step``) on the 1.5B MoE (GPU_MOE of
benchmarks/gpu/common.py; 16 heads, 32 experts) over NCCL, and that every layout gives the same
loss and gradient norm as cp 1 (bf16 compute, so equal up to bf16 rounding, not bitwise).

Each layout ``cp,tp,ep`` runs ``--world`` processes (one GPU each; dp = world / (cp*tp*ep)), each
rank's model initialised on its device from the same seed, Router Replay on, activation
checkpointing ``--ac``, the same ``--world`` rows of ``--seq-len`` tokens in every layout (each rank
trains its ``world / (dp * ep)`` rows one per micro-batch, ``trainer.micro_batch_tokens = seq_len``,
each row split over the rank's cp group), so every layout's loss and gradient norm are the same step's. Without CUDA (``--tiny``) the ranks are gloo processes on the CPU: a
check of the script. Writes ``DIR/long_context_mesh.json``: ``{"runs": [{"seq_len", "cp", "tp",
"ep", "world", "peak_bytes_per_rank", "tokens_per_s", "loss", "grad_norm"}]}``. No Hydra.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.gpu.bench_trainer_step import synthetic_batch
from benchmarks.gpu.long_context_step import step_arguments
from benchmarks.gpu.common import GPU_MOE, TINY_MOE, device_info, init_on_device, write_result
from workers.common.config import RunConfig, TrainerConfig
from benchmarks.local_ranks import run_ranks
from workers.trainer.batch import shard_rows
from workers.trainer.loop import build_optimizer, parallelize
from workers.trainer.micro import apply_activation_checkpointing
from workers.trainer.parallel.dims import ParallelDims
from workers.trainer.step import train_step

RESULT_NAME = "long_context_mesh"


def run_config(args: argparse.Namespace) -> RunConfig:
    base = TINY_MOE if args.tiny else GPU_MOE
    model = dataclasses.replace(base, name="long_context_mesh",
                                max_position_embeddings=max(args.seq_len, base.max_position_embeddings))
    trainer = TrainerConfig(dtype=args.dtype, master_dtype="float32", activation_checkpointing=args.ac,
                            router_replay=True, logprob_chunk_tokens=args.chunk, lr=1e-5, micro_batch_tokens=args.seq_len, ratio_mask_low=1e-9,
                            ratio_mask_high=1e9)
    return RunConfig(experiment="long_context_mesh", model=model, trainer=trainer)


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, layout: tuple[int, int, int], out: str) -> None:
    cp, tp, ep = layout
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    dims = ParallelDims(rank=rank, world_size=world, dp=world // (cp * tp * ep), tp=tp, ep=ep, cp=cp, backend=backend,
                        device=device, group=dist.group.WORLD)
    dims.groups = dims.new_groups()
    try:
        cfg = run_config(args)
        full = init_on_device(cfg.model, device, torch.float32, seed=cfg.model.init_seed)
        apply_activation_checkpointing(full.model.layers, cfg.trainer.activation_checkpointing)
        model = parallelize(cfg, full, dims)
        optimizer = build_optimizer(model, cfg.trainer)
        batch = synthetic_batch(cfg.model, world, args.seq_len, seed=args.seed)
        shard = shard_rows(batch, dims.batch_rank, dims.num_batch_shards).to(device)
        times, first = [], None
        for i in range(args.warmup + args.iters):
            if i == args.warmup and cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            stats = train_step(model, optimizer, shard, cfg.trainer, dims)
            first = first or stats  # the step from the common initial weights: compared across layouts
            if cuda:
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        peak = torch.tensor([torch.cuda.max_memory_allocated(device) if cuda else 0], dtype=torch.float64, device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if rank == 0:
            step_s = sorted(times)[len(times) // 2]
            row = {"seq_len": args.seq_len, "cp": cp, "tp": tp, "ep": ep, "world": world,
                   "peak_bytes_per_rank": int(peak.item()) if cuda else None,
                   "tokens_per_s": world * args.seq_len / step_s, "step_s": times,
                   "loss": first["loss"], "grad_norm": first["grad_norm"]}
            torch.save(row, out)
    finally:
        dist.destroy_process_group()


def run_layout(args: argparse.Namespace, layout: tuple[int, int, int], tmp: Path) -> dict:
    out = str(tmp / ("_".join(map(str, layout)) + ".pt"))
    run_ranks(_rank, args.world, (args, layout, out), what=f"layout cp,tp,ep={layout}", timeout_s=3600.0,
              start_method="spawn")
    return torch.load(out)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=torch.cuda.device_count() or 4)
    ap.add_argument("--layouts", nargs="+", default=["1,1,1", "4,1,1", "4,2,1", "4,1,2", "2,2,2"],
                    help="cp,tp,ep per layout (each divides --world)")
    args = step_arguments(ap, tiny_help="TINY_MOE: a CPU (gloo) check of the script").parse_args(argv)
    for text in args.layouts:
        cp, tp, ep = map(int, text.split(","))
        if args.world % (cp * tp * ep):
            ap.error(f"layout {text}: cp({cp}) * tp({tp}) * ep({ep}) does not divide --world({args.world})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for text in args.layouts:
            row = run_layout(args, tuple(map(int, text.split(","))), Path(tmp))
            runs.append(row)
            peak = row["peak_bytes_per_rank"]
            print(f"cp {row['cp']} tp {row['tp']} ep {row['ep']} (world {row['world']})  seq_len {row['seq_len']}  "
                  f"peak/rank {'-' if peak is None else f'{peak / 2**30:.2f} GiB'}  {row['tokens_per_s']:,.0f} tok/s  "
                  f"loss {row['loss']:.6f}  grad_norm {row['grad_norm']:.6f}", flush=True)
    result = {"device_info": device_info(), "argv": sys.argv[1:] if argv is None else list(argv), "runs": runs,
              "activation_checkpointing": args.ac, "dtype": args.dtype, "model": "tiny" if args.tiny else "GPU_MOE 1.5B"}
    print(f"wrote {write_result(Path(args.out), RESULT_NAME, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
