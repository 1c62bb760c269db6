"""Expert-parallel dispatch on several GPUs: exact split sizes vs fixed capacity (issue 19 item 2).

One process per GPU (NCCL; gloo on CPU with --tiny), ep = world, the mesh plan through the trainer's
own step (workers/trainer/step.py train_step, Router Replay on, fused AdamW). For each
``trainer.parallel.ep_capacity_factor`` in --factors (0 = exact dispatch: one host read of the
split sizes per MoE block and micro-batch; > 0 = workers/trainer/parallel/expert_capacity.py) rank 0 reports
the median step time, the loss and grad norm of the first step (equal across factors unless a
step overflowed and was redone), the redo count, and on CUDA the synchronising calls of one step
(torch.cuda.set_sync_debug_mode: every host read the step makes, all layers included).

    PYTHONPATH=$PWD python3 -m benchmarks.gpu.bench_ep_dispatch --world 2            # 2 H200s, 1.5B MoE
    PYTHONPATH=$PWD python3 -m benchmarks.gpu.bench_ep_dispatch --tiny --world 2     # CPU smoke test

Writes ep_dispatch.json under --out.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import socket
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import benchmarks.gpu.bench_trainer_step as b
from benchmarks.gpu.common import device_info, write_result
from workers.common.rank_exit import rank_entry
from workers.trainer.parallel import expert_capacity
from workers.trainer.batch import shard_rows
from workers.trainer.loop import build_optimizer, initial_model, parallelize
from workers.trainer.parallel.dims import ParallelDims
from workers.trainer.step import train_step


def _dims(rank: int, world: int, port: int) -> ParallelDims:
    cuda = torch.cuda.is_available()
    backend, device = ("nccl", torch.device("cuda", rank)) if cuda else ("gloo", torch.device("cpu"))
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    dims = ParallelDims(rank=rank, world_size=world, dp=1, ep=world, backend=backend, device=device,
                        group=dist.group.WORLD)
    dims.groups = dims.new_groups()
    return dims


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _host_syncs(step) -> int:
    """Synchronising CUDA calls during ``step()`` (0 on CPU: nothing to count)."""
    if not torch.cuda.is_available():
        step()
        return 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dims = _dims(rank, world, port)
    try:
        cfg = b.run_config(args, replay=True, ac=args.activation_checkpointing)
        cfg.trainer.parallel.ep = world
        cpu_init = initial_model(cfg)
        base = b.synthetic_batch(cfg.model, args.rows * world, args.seq_len, seed=args.seed)
        rows = []
        for factor in args.factors:
            model = parallelize(cfg, copy.deepcopy(cpu_init).to(dims.device), dims)
            expert_capacity.configure(model, factor)
            opt = build_optimizer(model, cfg.trainer)
            batch = shard_rows(base, dims.batch_rank, dims.num_batch_shards).to(dims.device)
            batch = b.with_model_logprobs(model, batch, replay=True, seed=args.seed)
            first = train_step(model, opt, batch, cfg.trainer, dims)
            for _ in range(args.warmup - 1):
                train_step(model, opt, batch, cfg.trainer, dims)
            syncs = _host_syncs(lambda: train_step(model, opt, batch, cfg.trainer, dims))
            times = []
            for _ in range(args.iters):
                _sync()
                t0 = time.perf_counter()
                stats = train_step(model, opt, batch, cfg.trainer, dims)
                _sync()
                times.append(time.perf_counter() - t0)
            rows.append({"ep_capacity_factor": factor, "step_ms": 1e3 * sorted(times)[len(times) // 2],
                         "loss": first["loss"], "grad_norm": first["grad_norm"], "host_syncs_per_step": syncs,
                         "ep_overflow_steps": stats.get("ep_overflow_steps", 0)})
            del model, opt
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=max(2, torch.cuda.device_count()), help="GPUs = ep")
    ap.add_argument("--factors", default="0,2,1.25", help="comma list of ep_capacity_factor values")
    ap.add_argument("--out-dir", default="benchmarks/out/gpu/")
    args, rest = ap.parse_known_args(argv)
    bench = b.parse_args(rest + ["--skip-direct"])
    bench.factors = [float(f) for f in args.factors.split(",")]
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = Path(args.out_dir) / ".ep_dispatch_rank0.json"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    mp.start_processes(rank_entry, args=(_rank, args.world, port, bench, str(tmp)), nprocs=args.world,
                       start_method="spawn" if torch.cuda.is_available() else "fork")
    rows = json.loads(tmp.read_text())
    tmp.unlink()
    for r in rows:
        print(f"factor {r['ep_capacity_factor']:>5g}: {r['step_ms']:9.1f} ms/step  loss {r['loss']:.6f}  "
              f"grad_norm {r['grad_norm']:.5f}  host syncs/step {r['host_syncs_per_step']}  redone {r['ep_overflow_steps']}")
    result = {"device_info": device_info(), "world": args.world, "ep": args.world, "tiny": bench.tiny,
              "rows_per_rank": bench.rows, "seq_len": bench.seq_len, "runs": rows}
    path = write_result(Path(args.out_dir), "ep_dispatch", result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
