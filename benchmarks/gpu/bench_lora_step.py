"""The LoRA trainer step against the full one at qwen3_moe's real shapes (issue 44's GPU part).

    python -m benchmarks.lora --gpu-step --out DIR          # one H100 / H200: full, LoRA r8, LoRA r32
    python -m benchmarks.lora --gpu-step --toy --out DIR    # CPU smoke: the same code at toy widths

Shapes: ``benchmarks.model_parity --size real``'s qwen3_moe (128 experts top-8, vocab 151936, hidden
2048, moe_intermediate 768, 32 heads / 4 kv heads of 128) with ``--layers`` decoder layers (default 4:
full fine-tuning's 16 B per parameter then stays well inside an H100; ~0.63B parameters a layer, the
head and embeddings 0.62B). Batch: ``--rows`` x ``--seq-len`` tokens, the synthetic batch of
bench_trainer_step.py with the model's own log-probs (ratios near 1).

Rows, each on a freshly built model with the same weights (normal 0.02, seed 0) and batch:
  full       the trainer's step as bench_real_step.py runs it: fp32 master, FSDP2 of world 1 with bf16
             compute, ``trainer.compile=layers``, the ``fused_loss`` head, fused AdamW on every parameter;
  lora_rR    the trainer's LoRA mode (workers/trainer/loop.py step0_model): the base built in bf16 and
             frozen (no master, no gradient, no AdamW state), float32 adapters on attention and on every
             expert (``per_expert``: [E, r, in] / [E, out, r] through the experts' grouped GEMMs), AdamW
             on the adapters only; same compile, head and FSDP2 plan.
Measured: median step seconds after ``--warmup`` steps (compiles), peak CUDA memory, trainable
parameters; ``step_over_full`` and ``peak_over_full`` per LoRA row. The backward still computes every
activation gradient through the frozen base (only the base's weight gradients and its AdamW go), so
LoRA's step is expected near 2/3 of the full one's model FLOPs, plus the adapters' own matmuls.
Writes ``lora_step.json`` under ``--out`` (default benchmarks/out/gpu; ``--record``: benchmarks/results/gpu).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from pathlib import Path

import torch

from benchmarks import model_shapes
from benchmarks.gpu.bench_real_step import family_config, random_init_, timed_steps
from benchmarks.gpu.bench_trainer_step import synthetic_batch, with_model_logprobs, world_of_one
from benchmarks.record import results_dir
from workers.common.config import RunConfig, TrainerConfig
from workers.common.config.lora import LoraConfig
from workers.common.registry import MODELS
from workers.trainer import lora_publish
from workers.trainer.compile import apply_compile
from workers.trainer.loop import build_optimizer, num_trainable, parallelize

FAMILY = "qwen3_moe"


def build(mcfg, tcfg: TrainerConfig, dims, *, compile_backend: str):
    """The model and optimizer of one row, in the trainer's order (loop.step0_model's full-model path)."""
    cfg = RunConfig(experiment="bench_lora_step", model=mcfg, trainer=tcfg)
    lora = tcfg.lora.enabled
    compute = torch.bfloat16 if tcfg.dtype == "bfloat16" else torch.float32
    full = MODELS.get(FAMILY).build(mcfg, device=dims.device, dtype=compute if lora else torch.float32)
    random_init_(full, 0)  # the base's values: the same for every row (drawn in the build dtype)
    if lora:
        lora_publish.init_in_place(cfg, full)  # adapters (float32, B = 0) on attention + experts, base frozen
    apply_compile(full.model.layers, tcfg.compile, device=dims.device, backend=compile_backend)
    model = parallelize(cfg, full, dims)
    return model, build_optimizer(model, tcfg)


def bench_row(name: str, mcfg, tcfg: TrainerConfig, dims, args, flops: float) -> dict:
    t0 = time.perf_counter()
    model, opt = build(mcfg, tcfg, dims, compile_backend=args.compile_backend)
    batch = with_model_logprobs(model, synthetic_batch(mcfg, args.rows, args.seq_len, seed=0).to(dims.device),
                                replay=False, seed=1)
    build_s = time.perf_counter() - t0
    step_s, peak = timed_steps(model, opt, batch, tcfg, dims, warmup=args.warmup, iters=args.iters)
    row = {"name": name, "family": FAMILY, "rank": tcfg.lora.rank, "layers": mcfg.num_layers,
           "params": sum(p.numel() for p in model.parameters()), "trainable": num_trainable(model),
           "tokens_per_step": args.rows * args.seq_len, "step_s": step_s,
           "tokens_per_s": args.rows * args.seq_len / step_s, "build_s": build_s, "peak_bytes": peak,
           "mfu_full_flops": flops / step_s / model_shapes.H200_BF16_PEAK}
    print(f"{name:9s} trainable {row['trainable']:>13,d}  step {step_s:7.3f} s  {row['tokens_per_s']:9.0f} tok/s"
          + (f"  peak {peak / 2**30:6.1f} GiB" if peak is not None else ""), flush=True)
    del model, opt, batch
    gc.collect()
    torch._dynamo.reset()  # each row compiles its own layers
    if dims.device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def run(args) -> dict:
    model_type, kw = model_shapes.real_configs()[FAMILY]
    kw = {**kw, "num_hidden_layers": args.layers}
    mcfg = family_config(FAMILY, model_type, kw)
    dims = world_of_one()
    cuda = dims.device.type == "cuda"
    compile_mode = args.compile if args.compile != "auto" else "layers" if cuda else "none"
    base = TrainerConfig(dtype="bfloat16" if cuda else "float32", master_dtype="float32", compile=compile_mode,
                         lr=1e-5, logprob_head="fused_loss")
    meta = MODELS.get(FAMILY).build(mcfg, device="meta", dtype=torch.float32)
    flops = model_shapes.train_flops_per_token(meta, kw, args.seq_len) * args.rows * args.seq_len
    del meta
    rows = []
    info = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "shape": {**{k: kw[k] for k in (
                "vocab_size", "hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok",
                "num_attention_heads", "num_key_value_heads", "head_dim")}, "num_hidden_layers": args.layers},
            "rows_x_seq": [args.rows, args.seq_len], "compile": compile_mode, "warmup": args.warmup,
            "iters": args.iters, "lora_targets": ["attention", "experts"], "lora_experts": "per_expert"}
    specs = [(f"lora_r{r}", r) for r in args.ranks] + [("full", 0)]  # LoRA first: smaller, kept if full OOMs
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "lora_step.json"
    for name, rank in specs:
        lcfg = LoraConfig(rank=rank, alpha=32.0, targets=["attention", "experts"]) if rank else LoraConfig()
        tcfg = dataclasses.replace(base, lora=lcfg, lr=base.lr * (10.0 if rank else 1.0))
        rows.append(bench_row(name, mcfg, tcfg, dims, args, flops))
        path.write_text(json.dumps({**info, "rows": rows}, indent=1) + "\n")  # a time limit keeps finished rows
    full = next((r for r in rows if r["rank"] == 0), None)
    for r in rows:
        if full and r["rank"]:
            r["step_over_full"] = r["step_s"] / full["step_s"]
            r["peak_over_full"] = (r["peak_bytes"] / full["peak_bytes"]) if full["peak_bytes"] else None
            print(f"{r['name']}: step x{r['step_over_full']:.3f} of full"
                  + (f", peak memory x{r['peak_over_full']:.3f}" if r["peak_over_full"] else ""), flush=True)
    out = {**info, "rows": rows}
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ranks", default="8,32", help="LoRA ranks, one row each beside full fine-tuning")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--compile", choices=("auto", "layers", "none"), default="auto",
                    help="trainer.compile for every row (auto: layers on CUDA, none on the CPU)")
    ap.add_argument("--compile-backend", default="inductor", help="aot_eager: a CPU check of the compiled rows")
    ap.add_argument("--toy", action="store_true", help="CPU, toy widths (model_parity's shrunk real configs), 2 x 32 "
                                                       "tokens, eager (--compile layers: aot_eager)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    a.ranks = [int(r) for r in a.ranks.split(",") if r]
    a.out = a.out or results_dir("gpu")
    if a.toy:
        model_shapes.shrink_real_configs()
        a.layers, a.rows, a.seq_len, a.warmup, a.iters, a.compile_backend = 2, 2, 32, 1, 1, "aot_eager"
    run(a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
