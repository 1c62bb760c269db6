"""Where the real trainer step's time goes (one process): fp32 vs bf16 master, then a torch.profiler
table of two fp32-master steps (kernels by CUDA time, ops by CPU time).

    PYTHONPATH=$PWD python3 benchmarks/gpu/profile_trainer_step.py [bench_trainer_step args, e.g. --tiny]

Result of 2026-12-03 on the H200: benchmarks/results/gpu/raw/trainer_step_profile_2026-12-03.log.
"""
import dataclasses
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import benchmarks.gpu.bench_trainer_step as b
from workers.trainer.loop import initial_model
from workers.trainer.step import train_step

args = b.parse_args(["--iters", "5"] + sys.argv[1:])
dims = b.world_of_one()
cfg0 = b.run_config(args, replay=False, ac="none")
cpu_init = initial_model(cfg0)
base = b.synthetic_batch(cfg0.model, args.rows, args.seq_len, seed=0)
for master in ("float32", "bfloat16"):
    cfg = dataclasses.replace(cfg0, trainer=dataclasses.replace(cfg0.trainer, master_dtype=master))
    init = cpu_init if master == "float32" else cpu_init.to(torch.bfloat16)
    model, opt = b.trainer_model(cfg, dims, init="step0", cpu_init=init)
    batch = b.with_model_logprobs(model, base.to(dims.device), replay=False, seed=1)
    for _ in range(3):
        train_step(model, opt, batch, cfg.trainer, dims)
    (torch.cuda.synchronize() if torch.cuda.is_available() else None)
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        train_step(model, opt, batch, cfg.trainer, dims)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    print(f"master {master}: step {sorted(ts)[2]*1e3:.1f} ms", flush=True)
    if master == "float32":
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                train_step(model, opt, batch, cfg.trainer, dims)
            (torch.cuda.synchronize() if torch.cuda.is_available() else None)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60), flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60), flush=True)
        with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:  # where the launches come from
            train_step(model, opt, batch, cfg.trainer, dims)
            (torch.cuda.synchronize() if torch.cuda.is_available() else None)
        wanted = ("aten::copy_", "aten::_to_copy", "aten::add_", "aten::mul_", "cudaMemcpyAsync",
                  "cudaStreamSynchronize", "aten::empty_strided", "aten::sum", "aten::item", "aten::cat")
        rows = [e for e in prof.key_averages(group_by_stack_n=7) if e.key in wanted]
        rows.sort(key=lambda e: -e.count)
        print("== launches by Python stack (one step; count, self CPU ms, op, innermost frames) ==")
        for e in rows[:40]:
            frames = [f for f in e.stack if "torch/" not in f or "distributed/fsdp" in f or "optim/" in f][:5]
            print(f"{e.count:6d} {e.self_cpu_time_total / 1e3:8.2f} {e.key:24s} " + " <- ".join(frames), flush=True)
    del model, opt, batch
    (torch.cuda.empty_cache() if torch.cuda.is_available() else None)
