"""The trainer step on one GPU under each plan and optimizer (issue 19's GPU-step overheads):

  fsdp+foreach  the FSDP2 plan with the default (foreach) AdamW: the 2026-12-03 baseline;
  fsdp+fused    the same with the fused AdamW the trainer now builds on CUDA (loop.build_optimizer);
  mesh+fused    the mesh plan (workers/trainer/parallel/mesh.py) at world 1: each MoE block's experts
                run through the stacked experts (workers/models/blocks/experts.py) (one grouped GEMM per projection), the
                path tp/ep runs take on GPUs; its loss must equal the FSDP plan's (same math);
  fsdp+fused+compile, mesh+fused+compile
                the same with trainer.compile=layers (workers/trainer/compile.py: each decoder layer
                torch.compile-d; ``--compile-backend``, inductor by default); the loss must match
                the eager rows' up to bf16 rounding (fused kernels round differently).

    PYTHONPATH=$PWD python3 benchmarks/gpu/bench_mesh_step.py [bench_trainer_step args, e.g. --tiny]

Prints one line per row (median step ms of --iters, loss, grad norm) and writes mesh_step.json
under --out.
"""
import copy
import dataclasses
import json
import os
import sys
import time

import torch

import benchmarks.gpu.bench_trainer_step as b
from workers.trainer.parallel import mesh
from workers.trainer.compile import apply_compile
from workers.trainer.loop import build_optimizer, initial_model, parallelize
from workers.trainer.precision import Precision
from workers.trainer.step import train_step


def timed(cfg, dims, model, opt, batch, iters: int) -> tuple[float, dict, float]:
    """(median step seconds, the first step's stats, the first step's seconds: compiling included)."""
    t0 = time.perf_counter()
    first = train_step(model, opt, batch, cfg.trainer, dims)  # warm-up; its stats compare the plans
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    train_step(model, opt, batch, cfg.trainer, dims)  # second warm-up: a recompile for the new shapes, if any
    ts = []
    for _ in range(iters):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        train_step(model, opt, batch, cfg.trainer, dims)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2], first, first_s


def main() -> None:
    args = b.parse_args(["--iters", "5"] + sys.argv[1:])
    dims = b.world_of_one()
    cfg = b.run_config(args, replay=True, ac="none")
    cpu_init = initial_model(cfg)
    base = b.synthetic_batch(cfg.model, args.rows, args.seq_len, seed=0)
    rows, batch = [], None
    for name in ("fsdp+foreach", "fsdp+fused", "mesh+fused", "fsdp+fused+compile", "mesh+fused+compile"):
        full = copy.deepcopy(cpu_init).to(dims.device)
        if name.endswith("+compile"):
            apply_compile(full.model.layers, "layers", backend=args.compile_backend)
        if name.startswith("mesh"):
            model = mesh.parallelize(full, dims, precision=Precision.of(cfg.trainer))
        else:
            model = parallelize(cfg, full, dims)
        if "foreach" in name:
            t = cfg.trainer
            opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
        else:
            opt = build_optimizer(model, cfg.trainer)
        if batch is None:
            batch = b.with_model_logprobs(model, base.to(dims.device), replay=True, seed=1)
        s, stats, first_s = timed(cfg, dims, model, opt, batch, args.iters)
        row = {"row": name, "step_ms": s * 1e3, "loss": stats["loss"], "grad_norm": stats["grad_norm"],
               "tokens": args.rows * args.seq_len, "first_step_s": first_s}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del model, opt
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "mesh_step.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                   "torch": torch.__version__, "config": dataclasses.asdict(cfg.model), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
