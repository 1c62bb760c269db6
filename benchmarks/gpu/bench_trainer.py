"""Trainer step throughput and MFU on packed sequences (issue 11, item 2).

One step = the trainer's math on one batch: model forward (grouped-GEMM experts, causal
flash attention on CUDA) -> ``token_logprobs`` and ``policy_loss`` of workers/trainer/loss.py
plus the model's balance loss -> backward -> grad-norm clip -> AdamW. Parameters, grads and
AdamW states are bf16 (``trainer.dtype=bfloat16``). A "packed" row is one sequence of
``seq_len`` tokens with causal attention over the whole row (documents packed back to
back without a per-document mask, torchtitan's default); every row has a 1/8 prompt that
carries no loss.

MFU = train_flops_per_token (benchmarks/gpu/common.py) x tokens/s / 989e12.
"""
from __future__ import annotations

import argparse
import math

import torch
from torch.nn.attention import SDPBackend

import workers.models.blocks.kernels as tm
from benchmarks.gpu.common import (H200_BF16_PEAK, free_cuda, init_on_device, param_counts, presets, sync, time_it,
                                   train_flops_per_token)
from workers.trainer.loss import policy_loss, token_logprobs


def make_batch(cfg, rows: int, seq_len: int, device, gen: torch.Generator) -> dict:
    ids = torch.randint(0, cfg.vocab_size, (rows, seq_len), device=device, generator=gen)
    loss_mask = torch.ones(rows, seq_len, dtype=torch.bool, device=device)
    loss_mask[:, : max(1, seq_len // 8)] = False
    # Inference log-probs near the trainer's (uniform-ish at random init): ratios stay ~1.
    inf_lp = torch.full((rows, seq_len), -math.log(cfg.vocab_size), device=device)
    inf_lp += 0.01 * torch.randn(rows, seq_len, device=device, generator=gen)
    adv = torch.randn(rows, device=device, generator=gen)
    return {"input_ids": ids, "loss_mask": loss_mask, "inference_logprobs": inf_lp, "advantages": adv}


def train_step(model, opt, batch: dict, aux_coef: float = 0.01) -> float:
    out = model(batch["input_ids"])
    logp, entropy = token_logprobs(out.logits, batch["input_ids"], 1.0)
    n = float(batch["loss_mask"].sum())
    pg, _stats = policy_loss(logp, batch["inference_logprobs"], batch["advantages"], batch["loss_mask"],
                             num_loss_tokens=n, ratio_cap=2.0, ratio_mask_low=0.2, ratio_mask_high=5.0,
                             entropy=entropy)
    loss = pg + aux_coef * out.aux_loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss.detach())


def bench_one(cfg, name: str, seq_len: int, tokens_per_step: int, device, *, warmup: int, iters: int,
              compile_model: bool = False, profile_step: bool = False, causal_backends=None) -> dict:
    tm.CAUSAL_SDPA_BACKENDS = causal_backends
    try:
        return _bench_one(cfg, name, seq_len, tokens_per_step, device, warmup=warmup, iters=iters,
                          compile_model=compile_model, profile_step=profile_step)
    finally:
        tm.CAUSAL_SDPA_BACKENDS = None


def _bench_one(cfg, name: str, seq_len: int, tokens_per_step: int, device, *, warmup: int, iters: int,
               compile_model: bool, profile_step: bool) -> dict:
    rows = max(1, tokens_per_step // seq_len)
    model = init_on_device(cfg, device, torch.bfloat16, seed=0).train()
    fwd = torch.compile(model) if compile_model else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0, foreach=True)
    gen = torch.Generator(device=device).manual_seed(1)
    batch = make_batch(cfg, rows, seq_len, device, gen)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t = time_it(lambda: train_step(fwd, opt, batch), device, warmup=warmup, iters=iters)
    profile = None
    if profile_step:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch_profile(activities=acts) as prof:
            train_step(fwd, opt, batch)
            sync(device)
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        profile = prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70)
    tokens = rows * seq_len
    tps = tokens / t["median_s"]
    fl = train_flops_per_token(cfg, seq_len)
    res = {
        "model": name, "seq_len": seq_len, "causal_sdpa_backends": str(tm.CAUSAL_SDPA_BACKENDS or "torch default"), "rows": rows, "tokens_per_step": tokens, "compiled": compile_model,
        "step_s": t, "tokens_per_s": tps,
        "flops_per_token": fl,
        "mfu": fl["total"] * tps / H200_BF16_PEAK,
        "mfu_causal_attention": fl["total_causal"] * tps / H200_BF16_PEAK,
        "achieved_tflops": fl["total"] * tps / 1e12,
        "params": param_counts(cfg),
        "peak_memory_gib": (torch.cuda.max_memory_allocated(device) / 2**30) if device.type == "cuda" else None,
        "profile_top_kernels": profile,
    }
    del model, fwd, opt, batch
    free_cuda()
    return res


def run(args: argparse.Namespace, device: torch.device) -> dict:
    moe, dense = presets(args.tiny)
    seqs = (64, 256) if args.tiny else (4096, 16384)
    tokens = 512 if args.tiny else args.tokens_per_step
    warmup, iters = (1, 2) if args.tiny else (2, args.iters)
    results = []
    for cfg, name in ((dense, "dense"), (moe, "moe")):
        for s in seqs:
            r = bench_one(cfg, name, s, tokens, device, warmup=warmup, iters=iters, profile_step=(s == seqs[0]))
            print(f"  trainer {name:5s} seq {s:6d}: {r['tokens_per_s']:10.0f} tok/s  MFU {r['mfu']:.3f} "
                  f"(causal-attn {r['mfu_causal_attention']:.3f})  step {r['step_s']['median_s']:.3f}s", flush=True)
            results.append(r)
    if device.type == "cuda":  # flash attention instead of torch's pick (cuDNN): which is faster here?
        for s in seqs:
            r = bench_one(moe, "moe", s, tokens, device, warmup=warmup, iters=iters,
                          causal_backends=[SDPBackend.FLASH_ATTENTION])
            print(f"  trainer moe   seq {s:6d} flash-attn: {r['tokens_per_s']:10.0f} tok/s  MFU {r['mfu']:.3f}", flush=True)
            results.append(r)
    return {"runs": results, "formula": "MFU = (6*N_active + 12*L*hidden*seq) * tokens/s / 989e12; "
            "N_active = L*(4h^2 + h*E + top_k*3*h*I) + V*h (lm_head; embedding lookup excluded); "
            "mfu_causal_attention uses 6*L*hidden*seq for attention"}


def run_compiled(args: argparse.Namespace, device: torch.device) -> dict:
    """torch.compile of the model (loss and optimizer eager): what kernel fusion adds."""
    moe, dense = presets(args.tiny)
    seq = 256 if args.tiny else 4096
    tokens = 512 if args.tiny else args.tokens_per_step
    warmup, iters = (2, 2) if args.tiny else (3, args.iters)
    results = []
    for cfg, name in ((dense, "dense"), (moe, "moe")):
        r = bench_one(cfg, name, seq, tokens, device, warmup=warmup, iters=iters, compile_model=True)
        print(f"  trainer {name:5s} seq {seq:6d} compiled: {r['tokens_per_s']:10.0f} tok/s  MFU {r['mfu']:.3f}",
              flush=True)
        results.append(r)
    return {"runs": results}
