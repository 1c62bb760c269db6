"""Tokens/s and MFU of the REAL trainer step (issue 19): ``workers.trainer.step.train_step`` on the
model the trainer role builds, beside bench_trainer.py's direct-model step on the same shapes.

bench_trainer.py calls the model directly with bf16 parameters and bf16 AdamW. The trainer role
runs something else, and this measures that: ``initial_model`` (fp32 master weights) ->
``apply_activation_checkpointing`` -> ``parallelize`` (ModelSpec.trainer_plan: the generic FSDP2
plan at tp = ep = 1, bf16 compute through MixedPrecisionPolicy, fp32 gradient reduction) ->
AdamW built as workers/trainer/loop.py builds it -> ``train_step`` on a RolloutBatch (micro-batches,
Router Replay, the policy and balance losses with global normalisers, grad clip, AdamW). One
process, a process group of world 1 (NCCL on CUDA, gloo on CPU): FSDP2 with one rank, as a
one-GPU trainer runs it.

Rows of the table: replay off and on at the chosen activation checkpointing, each ``--extra-ac``
mode with replay off, the same again with ``trainer.compile=layers`` (``--extra-compile``, default on
CUDA: torch.compile/inductor of each decoder layer around its checkpoint, workers/trainer/compile.py),
and the direct-model step (bench_trainer.bench_one). The issue's target is
MFU >= 40% at 16k tokens, within 10% of the direct step (``ratio_vs_direct`` >= 0.9).
MFU = train_flops_per_token (common.py; recompute of checkpointing not counted) x tokens/s /
989e12, tokens = rows x seq_len (prompt tokens included, as in bench_trainer.py).

GPU: ``python -m benchmarks.gpu.bench_trainer_step`` (defaults: 4 x 4096 tokens, GPU_MOE);
CPU check: ``--tiny`` (TINY_MOE, seconds). Writes ``trainer_step.json`` under ``--out``.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.gpu import bench_trainer
from benchmarks.gpu.common import (GPU_MOE, H200_BF16_PEAK, TINY_MOE, device_info, free_cuda, init_on_device,
                                   param_counts, time_it, train_flops_per_token, write_result)
from workers.common.config import RunConfig, TrainerConfig
from workers.common.ports import free_port
from workers.trainer.batch import RolloutBatch
from workers.common.dtensor import local_part
from workers.trainer.loop import build_optimizer, initial_model, parallelize, trainer_plan
from workers.trainer.compile import apply_compile, resolve as resolve_compile
from workers.trainer.micro import apply_activation_checkpointing
from workers.trainer.parallel.dims import ParallelDims
from workers.trainer.step import forward_rows, train_step

RESULT_NAME = "trainer_step"


def run_config(args: argparse.Namespace, *, replay: bool, ac: str, compile: str = "none") -> RunConfig:
    """The run's config as the trainer would load it (no Hydra: the dataclasses themselves)."""
    model = dataclasses.replace(TINY_MOE if args.tiny else GPU_MOE, name="bench_tiny_moe" if args.tiny else "gpu_moe")
    trainer = TrainerConfig(dtype=args.dtype, master_dtype="float32", micro_batch_tokens=args.micro_batch_tokens,
                            activation_checkpointing=ac, router_replay=replay, lr=args.lr, compile=compile)
    return RunConfig(experiment="bench_trainer_step", model=model, trainer=trainer)


def world_of_one() -> ParallelDims:
    """A process group of world 1 on a free local port and the trainer's ParallelDims over it."""
    cuda = torch.cuda.is_available()
    backend, device = ("nccl", torch.device("cuda", 0)) if cuda else ("gloo", torch.device("cpu"))
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=300))
    dims = ParallelDims(rank=0, world_size=1, dp=1, backend=backend, device=device, group=dist.group.WORLD)
    dims.groups = dims.new_groups()
    return dims


def synthetic_batch(cfg, rows: int, seq_len: int, *, seed: int) -> RolloutBatch:
    """Rows of ``seq_len`` valid tokens, the first 1/8 prompt (no loss), random per-row advantages,
    random distinct routed experts per (token, layer) reported everywhere but the last token
    (SGLang never feeds the last sampled token). Inference log-probs are filled in later from
    the model itself (:func:`with_model_logprobs`). On the CPU; ``.to(device)`` moves it."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (rows, seq_len), generator=g)
    valid = torch.ones(rows, seq_len, dtype=torch.bool)
    loss = valid.clone()
    loss[:, : max(1, seq_len // 8)] = False
    experts = torch.rand(rows, seq_len, cfg.num_routed_layers, cfg.num_experts, generator=g).argsort(-1)
    routed_mask = valid.clone()
    routed_mask[:, -1] = False
    return RolloutBatch(input_ids=ids, attention_mask=valid, loss_mask=loss,
                        inference_logprobs=torch.zeros(rows, seq_len), advantages=torch.randn(rows, generator=g),
                        rewards=torch.randn(rows, generator=g), token_versions=torch.zeros(rows, seq_len, dtype=torch.int32),
                        routed_experts=experts[..., : cfg.top_k].contiguous(), routed_mask=routed_mask,
                        meta={"temperature": 1.0, "step": 0})


@torch.no_grad()
def with_model_logprobs(model, batch: RolloutBatch, *, replay: bool, seed: int) -> RolloutBatch:
    """``batch`` with inference log-probs = the model's own (one no-grad trainer forward) plus
    N(0, 0.01) noise on the loss tokens: importance ratios near 1, as an on-policy batch has."""
    logp = forward_rows(model, batch, replay=replay, pack=False).logp.float()
    g = torch.Generator(device=logp.device).manual_seed(seed)
    noisy = logp + 0.01 * torch.randn(logp.shape, device=logp.device, generator=g)
    return dataclasses.replace(batch, inference_logprobs=torch.where(batch.loss_mask, noisy, torch.zeros_like(noisy)))


def trainer_model(cfg: RunConfig, dims: ParallelDims, *, init: str, cpu_init, backend: str = "inductor"):
    """This rank's model and optimizer, in the loop's order (workers/trainer/loop.py step0_model):
    activation checkpointing, then trainer.compile around it (``backend``: aot_eager for CPU smoke runs)."""
    tcfg = cfg.trainer
    if init == "device":  # same distributions as the seeded init, drawn on the GPU (fast for 1.5B)
        full = init_on_device(cfg.model, dims.device, torch.float32, seed=cfg.model.init_seed)
    else:
        full = copy.deepcopy(cpu_init).to(dims.device)
    apply_activation_checkpointing(full.model.layers, tcfg.activation_checkpointing)
    apply_compile(full.model.layers, tcfg.compile, device=dims.device, backend=backend)
    model = parallelize(cfg, full, dims)
    optimizer = build_optimizer(model, tcfg)
    return model, optimizer


def bench_real(args: argparse.Namespace, dims: ParallelDims, base: RolloutBatch, *, replay: bool, ac: str,
               cpu_init, compile: str = "none") -> dict:
    """One row: build the trainer's model for this config, time train_step on the batch (the warm-up
    steps include torch.compile's compilation; ``first_step_s`` shows its cost)."""
    cfg = run_config(args, replay=replay, ac=ac, compile=compile)
    device = dims.device
    t0 = time.perf_counter()
    model, optimizer = trainer_model(cfg, dims, init=args.init, cpu_init=cpu_init, backend=args.compile_backend)
    build_s = time.perf_counter() - t0
    batch = with_model_logprobs(model, base.to(device), replay=replay, seed=args.seed + 1)
    watched = local_part(next(model.model.layers[0].parameters())).detach().clone()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    last: dict = {}

    def step():
        last.update(train_step(model, optimizer, batch, cfg.trainer, dims))

    t_first = time.perf_counter()
    step()  # the first step compiles (trainer.compile): timed apart, then the usual warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    first_s = time.perf_counter() - t_first
    t = time_it(step, device, warmup=max(0, args.warmup - 1), iters=args.iters)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    changed = float((local_part(next(model.model.layers[0].parameters())).detach() != watched).float().mean())
    opt_t = time_it(optimizer.step, device, warmup=1, iters=max(2, args.iters // 2))
    tokens = base.input_ids.numel()
    tps = tokens / t["median_s"]
    fl = train_flops_per_token(cfg.model, base.input_ids.shape[1])
    res = {
        "kind": "real", "router_replay": replay, "activation_checkpointing": ac,
        "compile": resolve_compile(compile, device), "compile_backend": args.compile_backend, "first_step_s": first_s,
        "micro_batch_tokens": cfg.trainer.micro_batch_tokens, "dtype": cfg.trainer.dtype,
        "master_dtype": cfg.trainer.master_dtype, "plan": trainer_plan(cfg), "init": args.init,
        "rows": base.num_rows, "seq_len": base.input_ids.shape[1], "tokens_per_step": tokens,
        "step_s": t, "tokens_per_s": tps, "mfu": fl["total"] * tps / H200_BF16_PEAK,
        "mfu_causal_attention": fl["total_causal"] * tps / H200_BF16_PEAK, "achieved_tflops": fl["total"] * tps / 1e12,
        "optimizer_step_s": opt_t["median_s"], "build_s": build_s, "peak_memory_gib": peak,
        "weights_changed_frac": changed,
        "last_step_stats": {k: last.get(k) for k in ("loss", "pg_loss", "aux_loss", "grad_norm", "ratio_mean",
                                                    "ratio_masked_frac", "routing_disagreement", "num_loss_tokens")},
    }
    del model, optimizer, batch, watched
    free_cuda()
    return res


def bench_direct(args: argparse.Namespace, device: torch.device, rows: int, seq_len: int) -> dict:
    """bench_trainer.py's direct-model step (bf16 parameters and AdamW) on the same config and shapes."""
    cfg = TINY_MOE if args.tiny else GPU_MOE
    r = bench_trainer.bench_one(cfg, "moe", seq_len, rows * seq_len, device, warmup=args.warmup, iters=args.iters)
    r.pop("profile_top_kernels", None)
    r.update(kind="direct", router_replay=False, activation_checkpointing="none", micro_batch_tokens=0,
             dtype="bfloat16", master_dtype="bfloat16")
    return r


def run(args: argparse.Namespace, device: torch.device | None = None) -> dict:
    """Every row of the table; destroys the process group it made (run_all runs this in-process)."""
    torch.manual_seed(args.seed)
    dims = world_of_one()
    try:
        mcfg = run_config(args, replay=False, ac="none").model
        base = synthetic_batch(mcfg, args.rows, args.seq_len, seed=args.seed)
        cpu_init, init_s = None, 0.0
        if args.init == "step0":
            t0 = time.perf_counter()
            cpu_init = initial_model(run_config(args, replay=False, ac="none"))  # fp32 master, on the CPU
            init_s = time.perf_counter() - t0
        ac0 = args.activation_checkpointing
        configs = [(False, ac0, args.compile), (True, ac0, args.compile)]
        configs += [(False, m, args.compile) for m in args.extra_ac.split(",") if m and m != ac0]
        for mode in [m for m in args.extra_compile.split(",") if m and m != args.compile]:
            configs += [(False, ac0, mode), (True, ac0, mode)]  # the compiled layers, replay off and on
            configs += [(False, m, mode) for m in args.extra_ac.split(",") if m and m != ac0]
        runs = []
        for replay, ac, mode in configs:
            r = bench_real(args, dims, base, replay=replay, ac=ac, cpu_init=cpu_init, compile=mode)
            runs.append(r)
            print("  " + table_row(r), flush=True)
        del cpu_init
        free_cuda()
    finally:
        dims.destroy()
    if not args.skip_direct:
        d = bench_direct(args, dims.device, args.rows, args.seq_len)
        runs.append(d)
        print("  " + table_row(d), flush=True)
        for r in runs[:-1]:
            r["ratio_vs_direct"] = r["tokens_per_s"] / d["tokens_per_s"]
    return {"runs": runs, "model": dataclasses.asdict(mcfg), "params": param_counts(mcfg), "init_s": init_s,
            "target": "MFU >= 0.40 at 16k tokens and ratio_vs_direct >= 0.9 (issue 19)",
            "formula": "MFU = (6*N_active + 12*L*hidden*seq) * tokens/s / 989e12 (bench_trainer.py's count); "
                       "activation-checkpointing recompute is not counted"}


def table_row(r: dict) -> str:
    what = (f"{r['kind']:6s} replay {'on ' if r['router_replay'] else 'off'} ac {r['activation_checkpointing']:9s} "
            f"compile {r.get('compile', 'none'):6s} mb {r['micro_batch_tokens']:>6d}")
    mem = r.get("peak_memory_gib")
    ratio = f"  x{r['ratio_vs_direct']:.2f} of direct" if "ratio_vs_direct" in r else ""
    return (f"{what}  {r['tokens_per_step']:>6d} tok  {r['tokens_per_s']:>10.0f} tok/s  MFU {r['mfu']:.3f}  "
            f"step {r['step_s']['median_s']:.3f}s  mem {mem if mem is None else round(mem, 1)} GiB{ratio}")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="TINY_MOE, 2 x 64 tokens: runs on CPU in seconds")
    ap.add_argument("--rows", type=int, default=None, help="rows of the batch (default 4; tiny 2)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 4096; tiny 64)")
    ap.add_argument("--micro-batch-tokens", type=int, default=0, help="trainer.micro_batch_tokens (0: one pass)")
    ap.add_argument("--activation-checkpointing", default="none", choices=("none", "full", "selective"))
    ap.add_argument("--extra-ac", default="full", help="comma list of further AC modes timed with replay off")
    ap.add_argument("--compile", default="none", choices=("none", "layers", "auto"),
                    help="trainer.compile of the first rows (none: the eager baseline)")
    ap.add_argument("--extra-compile", default=None,
                    help="comma list of trainer.compile modes timed again (replay off and on, and each --extra-ac); "
                         "default 'layers' on CUDA, none on CPU")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend (aot_eager: CPU smoke)")
    ap.add_argument("--dtype", default="bfloat16", help="trainer.dtype (compute); master is float32")
    ap.add_argument("--init", default="step0", choices=("step0", "device"),
                    help="step0: the loop's initial_model (CPU, seeded); device: same distributions drawn on the GPU")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2; tiny 1)")
    ap.add_argument("--iters", type=int, default=None, help="timed steps, median reported (default 10; tiny 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-direct", action="store_true", help="skip bench_trainer.py's direct-model row")
    ap.add_argument("--out", default="benchmarks/out/gpu/", help="directory for trainer_step.json")
    args = ap.parse_args(argv)
    if args.extra_compile is None:
        args.extra_compile = "layers" if torch.cuda.is_available() else ""
    for key, full, tiny in (("rows", 4, 2), ("seq_len", 4096, 64), ("warmup", 2, 1), ("iters", 10, 2)):
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.tiny else full)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"device_info": device_info(), "tiny": args.tiny, "argv": sys.argv[1:] if argv is None else list(argv)}
    result.update(run(args, device))
    path = write_result(Path(args.out), RESULT_NAME, result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
