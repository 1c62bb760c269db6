"""MFU of the REAL trainer step at real MoE shapes (128 experts, top-8, 152k / 164k vocabularies).

    python -m benchmarks.gpu.bench_real_step --out DIR                  # H200: qwen3_moe and deepseek_v3, 2 x 4096 tokens
    python -m benchmarks.gpu.bench_real_step --smoke --out /tmp/x        # CPU: the same code at toy widths

``workers.trainer.step.train_step`` as a one-GPU trainer runs it (benchmarks/gpu/bench_trainer_step.py
explains the pieces: fp32 master weights, FSDP2 of world 1 with bf16 compute, ``trainer.compile=layers``,
the policy loss through each ``--heads`` log-prob head, AdamW) on ``benchmarks.model_shapes.real_configs``,
the configs of ``benchmarks.model_parity --size real`` (same keys: the two benchmarks' rows are of one model).
Weights are drawn on the device (normal 0.02, norms 1; a speed benchmark). MFU = model FLOPs per
step (``benchmarks.model_shapes.train_flops_per_token``: 6 x active parameters + causal attention)
/ step time / 989 TFLOP/s. Writes ``real_step.json`` under ``--out``.

An RL step takes many micro-batches per optimizer step: ``--micro-batch-tokens N`` is
``trainer.micro_batch_tokens`` (gradient accumulation, workers/trainer/micro.py), so
``--rows 8 --seq-len 4096 --micro-batch-tokens 8192`` is one optimizer step over 32768 tokens in 4
forward/backward passes (``tokens_per_optimizer_step``, ``micro_batches``). Each row also splits
its step (``split``: seconds, synchronized around each part, medians over the timed steps):
``forward_backward`` (every micro-batch's forward, loss and backward; FSDP2's casts of the fp32
masters to bf16 happen inside it), ``grad_sync_clip`` (gradient reduction and clipping),
``optimizer`` (AdamW over the fp32 masters), ``bookkeeping`` (the rest: loss aggregation, the
micro-batch split, the statistics' one host read), and ``master_cast_est`` (one cast of every
master weight to the compute dtype, timed alone: at world 1 FSDP2 casts once per optimizer step,
workers/trainer/parallel/fsdp.py ``accumulate_unsharded``; an estimate of the share forward_backward holds).
``--micro-batch-tokens 16384,8192`` gives one row per budget on the same built model.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import time
from pathlib import Path

import torch

from benchmarks import model_shapes
from benchmarks.gpu.bench_trainer_step import synthetic_batch, with_model_logprobs, world_of_one
from workers.common.config import RunConfig, TrainerConfig
from workers.common.config.trainer import LOGPROB_HEADS
from workers.common.registry import MODELS
from workers.trainer.compile import apply_compile
from workers.trainer.loop import build_optimizer, parallelize
from workers.trainer import step as step_module
from workers.trainer.micro import split_micro_batches
from workers.trainer.step import train_step


class StepSplit:
    """Seconds per part of train_step, each part synchronized before and after (``wrap``)."""

    def __init__(self, sync):
        self.sync, self.seconds = sync, collections.defaultdict(float)

    def wrap(self, name: str, fn):
        def timed(*a, **k):
            self.sync()
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.sync()
                self.seconds[name] += time.perf_counter() - t
        return timed

    @contextlib.contextmanager
    def installed(self, model, opt):
        """The step's parts wrapped where train_step calls them (restored after)."""
        saved = step_module._forward_backward
        step_module._forward_backward = self.wrap("forward_backward", saved)
        model.sync_grads = self.wrap("grad_sync_clip", model.sync_grads)
        model.clip_grad_norm_ = self.wrap("grad_sync_clip", model.clip_grad_norm_)
        opt.step = self.wrap("optimizer", opt.step)
        try:
            yield self
        finally:
            step_module._forward_backward = saved
            for obj, name in ((model, "sync_grads"), (model, "clip_grad_norm_"), (opt, "step")):
                del obj.__dict__[name]


def master_cast_s(model, dtype: torch.dtype, sync) -> float:
    """One cast of every (local) master weight to ``dtype``: what FSDP2 does per all-gather under mixed precision."""
    params = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    times = []
    for _ in range(3):
        sync()
        t = time.perf_counter()
        casts = [p.detach().to(dtype) for p in params]
        sync()
        times.append(time.perf_counter() - t)
        del casts
    return sorted(times)[1]


def family_config(family: str, model_type: str, kw: dict):
    """Our model config for transformers' config kwargs (as model_parity's checkpoint round trip gives it)."""
    from transformers import AutoConfig

    spec = MODELS.get(family)
    hf = AutoConfig.for_model(model_type, **kw).to_dict()
    return spec.config(name=f"real_{family}", **spec.from_hf_config(hf))


@torch.no_grad()
def random_init_(model: torch.nn.Module, seed: int) -> None:
    """Normal(0, 0.02) matrices, ones for norm scales, zeros for biases, drawn on the model's device."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name and p.dim() == 1 and not name.endswith("bias"):
            p.fill_(1.0)
        elif p.dim() == 1:
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)


def timed_steps(model, opt, batch, tcfg, dims, *, warmup: int, iters: int) -> tuple[float, int | None]:
    """Median seconds of ``iters`` trainer steps after ``warmup`` (compiles), and the peak CUDA bytes
    allocated over all of them (None on the CPU)."""
    cuda = dims.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(warmup + iters):
        sync()
        t = time.perf_counter()
        train_step(model, opt, batch, tcfg, dims)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2], torch.cuda.max_memory_allocated() if cuda else None


def bench(family: str, args, dims) -> list[dict]:
    """One row per ``trainer.logprob_head`` in ``args.heads``, all on one built model (same weights,
    interleaved warm-up per head)."""
    model_type, kw = model_shapes.real_configs()[family]
    mcfg = family_config(family, model_type, kw)
    compile_mode = ("none" if args.compile_backend == "none" else
                    "layers" if dims.device.type == "cuda" or args.compile_backend != "inductor" else "none")
    tcfg = TrainerConfig(dtype="bfloat16" if dims.device.type == "cuda" else "float32", master_dtype="float32",
                         compile=compile_mode, lr=1e-5, logprob_head=args.heads[0],
                         micro_batch_tokens=args.micro_batch_tokens)
    cfg = RunConfig(experiment="bench_real_step", model=mcfg, trainer=tcfg)
    t0 = time.perf_counter()
    full = MODELS.get(family).build(mcfg, device=dims.device, dtype=torch.float32)
    random_init_(full, 0)
    flops = model_shapes.train_flops_per_token(full, kw, args.seq_len) * args.rows * args.seq_len
    params = sum(p.numel() for p in full.parameters())
    apply_compile(full.model.layers, tcfg.compile, device=dims.device, backend=args.compile_backend)
    model = parallelize(cfg, full, dims)
    opt = build_optimizer(model, tcfg)
    batch = with_model_logprobs(model, synthetic_batch(mcfg, args.rows, args.seq_len, seed=0).to(dims.device),
                                replay=False, seed=1)
    build_s = time.perf_counter() - t0
    sync = torch.cuda.synchronize if dims.device.type == "cuda" else (lambda: None)
    compute = torch.bfloat16 if tcfg.dtype == "bfloat16" else torch.float32
    cast_s = master_cast_s(model, compute, sync) if compute != torch.float32 else 0.0
    rows = []
    for head, micro_tokens in [(h, m) for h in args.heads for m in args.micro_batch_tokens]:
        tcfg = dataclasses.replace(tcfg, logprob_head=head, micro_batch_tokens=micro_tokens)
        num_micro = len(split_micro_batches(batch, micro_tokens, packed=tcfg.pack_sequences, dims=dims))
        step_s, peak = timed_steps(model, opt, batch, tcfg, dims, warmup=args.warmup, iters=args.iters)
        splits = []
        for _ in range(args.iters):  # the split: the same steps again, each part synchronized
            with StepSplit(sync).installed(model, opt) as split:
                t = time.perf_counter()
                train_step(model, opt, batch, tcfg, dims)
                sync()
                total = time.perf_counter() - t
            splits.append({**split.seconds, "bookkeeping": total - sum(split.seconds.values())})
        split = {k: sorted(s.get(k, 0.0) for s in splits)[len(splits) // 2]
                 for k in ("forward_backward", "grad_sync_clip", "optimizer", "bookkeeping")}
        split["master_cast_est"] = cast_s  # world 1: one cast per optimizer step (fsdp.accumulate_unsharded)
        row = {"family": family, "shape": "real", "vocab_size": kw["vocab_size"], "params": params,
               "num_experts": kw.get("num_experts") or kw.get("n_routed_experts"), "top_k": kw["num_experts_per_tok"],
               "tokens_per_step": args.rows * args.seq_len, "tokens_per_optimizer_step": args.rows * args.seq_len,
               "micro_batch_tokens": micro_tokens, "micro_batches": num_micro, "split": split,
               "logprob_head": head, "compile": compile_mode,
               "step_s": step_s, "tokens_per_s": args.rows * args.seq_len / step_s, "build_s": build_s,
               "mfu": flops / step_s / model_shapes.H200_BF16_PEAK, "peak_bytes": peak}
        print(f"{family:12s} {head:10s} params {params:>13,d}  step {step_s:7.3f} s  "
              f"{row['tokens_per_s']:9.0f} tok/s  MFU {100 * row['mfu']:5.1f}%  ({num_micro} micro-batches: "
              + ", ".join(f"{k} {v:.3f}" for k, v in split.items()) + " s)", flush=True)
        rows.append(row)
        if args.profile and dims.device.type == "cuda":
            from benchmarks.gpu.common import kernel_table
            kernel_table(lambda: train_step(model, opt, batch, tcfg, dims), f"{family} {head} {micro_tokens} step", rows=60,
                         sort_by="self_cuda_time_total")
    del model, opt, full
    if dims.device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default="qwen3_moe,deepseek_v3")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--heads", default="fused,fused_loss",
                    help="comma list of trainer.logprob_head values, one row each on the same model")
    ap.add_argument("--micro-batch-tokens", default="0",
                    help="trainer.micro_batch_tokens: gradient accumulation over micro-batches of this many tokens "
                         "(a comma list: one row each, on the same model)")
    ap.add_argument("--compile-backend", default="inductor", help="aot_eager: CPU smoke; none: no compilation")
    ap.add_argument("--profile", action="store_true", help="GPU: print one step's kernels by time after each row")
    ap.add_argument("--smoke", action="store_true", help="CPU, toy widths (model_parity --toy), 2 x 32 tokens")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu/local"))
    a = ap.parse_args(argv)
    a.heads = a.heads.split(",")
    a.micro_batch_tokens = [int(m) for m in a.micro_batch_tokens.split(",")]
    if unknown := [h for h in a.heads if h not in LOGPROB_HEADS]:
        ap.error(f"--heads: {unknown} not in {list(LOGPROB_HEADS)}")
    if a.smoke:
        model_shapes.shrink_real_configs()
        a.rows, a.seq_len, a.warmup, a.iters = 2, 32, 1, 1
        a.compile_backend = "aot_eager" if a.compile_backend == "inductor" else a.compile_backend
    dims = world_of_one()
    info = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__}
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for family in a.families.split(","):  # written after each family: a time limit keeps the finished rows
        rows += bench(family, a, dims)
        (a.out / "real_step.json").write_text(json.dumps({**info, "rows": rows}, indent=1) + "\n")
    print(f"wrote {a.out / 'real_step.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
