"""Where the real trainer step's time goes (one process): fp32 vs bf16 master, then a torch.profiler
table of two fp32-master steps (kernels by CUDA time, ops by CPU time).

    PYTHONPATH=$PWD python3 benchmarks/gpu/profile_trainer_step.py [bench_trainer_step args, e.g. --tiny]

Result of 2026-12-03 on the H200: benchmarks/results/gpu/raw/trainer_step_profile_2026-12-03_before_fixes.log.
"""
import collections
import dataclasses
import sys
import time
import traceback

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import benchmarks.gpu.bench_trainer_step as b
from workers.trainer.loop import initial_model
from workers.trainer.step import train_step

class OpsByCaller(TorchDispatchMode):
    """Counts aten calls of one step by the three innermost project / FSDP / optimizer frames (the
    profiler's with_stack grouping came back empty on the CPU run)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frames = [f for f in traceback.extract_stack(limit=40)
                  if any(k in f.filename for k in ("/workers/", "/fsdp/", "/optim/", "/autograd/"))]
        where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in frames[::-1][:3])
        self.counts[(func.overloadpacket.__name__, where)] += 1
        return func(*args, **(kwargs or {}))

    def print(self, top: int = 40) -> None:
        per_op = collections.Counter()
        for (op, _), n in self.counts.items():
            per_op[op] += n
        print("== aten calls in one step:", sum(per_op.values()), "by op:", per_op.most_common(20))
        for (op, where), n in self.counts.most_common(top):
            print(f"{n:6d} {op:24s} {where}", flush=True)


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
        counter = OpsByCaller()
        with counter:  # where the launches come from (one step)
            train_step(model, opt, batch, cfg.trainer, dims)
        counter.print()
    del model, opt, batch
    (torch.cuda.empty_cache() if torch.cuda.is_available() else None)
