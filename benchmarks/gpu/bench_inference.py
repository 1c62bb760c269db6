"""Embedded engine vs transformers ``generate`` on the same model and weights (issue 11, item 3).

Both decode a batch of ``num_prompts`` prompts (lengths spread over [P/2, P], so both pad)
for exactly ``max_new_tokens`` tokens each with a KV cache, greedily (so the outputs can be
compared token by token), in bf16 on one GPU. Output tokens/s = prompts x new tokens / wall
time from submission to the last token (prefill included). The HF twin is
Qwen3MoeForCausalLM (benchmarks/gpu/hf_equiv.py: q/k norms replaced by identity, experts
fused); its logits are checked against tiny_moe's on the same input first.
"""
from __future__ import annotations

import argparse
import threading
import time

import torch
from torch.nn.attention import sdpa_kernel

import workers.models.blocks.kernels as tm
from benchmarks.gpu.common import free_cuda, init_on_device, presets, sync
from workers.inference.embedded.engine import GenRequest, InferenceEngine


def prompts(vocab: int, n: int, max_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(max_len // 2, max_len + 1, (n,), generator=g)
    return [torch.randint(4, vocab, (int(l),), generator=g).tolist() for l in lens]


def engine_generate(model, ps: list[list[int]], new_tokens: int, *, temperature: float = 0.0,
                    routed: bool = False, seed: int = 0, timeout_s: float = 900.0):
    """Run one batch through a fresh engine, all requests queued before its thread starts."""
    engine = InferenceEngine(model, max_batch_size=len(ps), seed=seed)
    outs, done = {}, threading.Semaphore(0)
    reqs = [GenRequest(input_ids=p, temperature=temperature, max_new_tokens=new_tokens, return_routed_experts=routed)
            for p in ps]
    for r in reqs:
        engine.submit(r, lambda o: (outs.__setitem__(o.rid, o), done.release()))
    sync(engine.device)
    t0 = time.perf_counter()
    engine.start()
    deadline = time.monotonic() + timeout_s
    for _ in reqs:
        if not done.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"engine finished {len(outs)}/{len(reqs)} requests in {timeout_s}s")
    wall = time.perf_counter() - t0
    steps = engine.num_steps
    engine.shutdown()
    if engine.error is not None:
        raise engine.error
    return [outs[r.rid] for r in reqs], wall, steps


@torch.no_grad()
def hf_generate(hf, ps: list[list[int]], new_tokens: int, device, backends=None) -> tuple[torch.Tensor, float]:
    """transformers' generate; ``backends`` restricts SDPA as tiny_moe does for masked attention."""
    if backends is None:
        return _hf_generate(hf, ps, new_tokens, device)
    with sdpa_kernel(backends):
        return _hf_generate(hf, ps, new_tokens, device)


def _hf_generate(hf, ps: list[list[int]], new_tokens: int, device) -> tuple[torch.Tensor, float]:
    t = max(len(p) for p in ps)
    ids = torch.zeros(len(ps), t, dtype=torch.long)
    am = torch.zeros(len(ps), t, dtype=torch.long)
    for i, p in enumerate(ps):  # left padding, as the engine does
        ids[i, t - len(p):] = torch.tensor(p)
        am[i, t - len(p):] = 1
    ids, am = ids.to(device), am.to(device)
    sync(device)
    t0 = time.perf_counter()
    out = hf.generate(input_ids=ids, attention_mask=am, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                      do_sample=False, pad_token_id=0)
    sync(device)
    return out[:, t:].cpu(), time.perf_counter() - t0


@torch.inference_mode()
def decode_profile(model, ps: list[list[int]], device, steps: int = 3) -> str:
    """Top kernels of a few decode forwards at the benchmark's batch (KV cache after a prefill)."""
    from torch.profiler import ProfilerActivity, profile

    from workers.models.tiny_moe.model import KVCache

    ids = torch.tensor([p[: min(map(len, ps))] for p in ps], device=device)
    cache = KVCache(model.config.num_layers)
    model(ids, cache=cache)
    last = ids[:, -1:]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for i in range(steps):
            pos = torch.full_like(last, ids.shape[1] + i)
            model(last, position_ids=pos, cache=cache)
        sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=60)


def match_stats(a: list[list[int]], b: torch.Tensor) -> dict:
    prefix = []
    for row, ref in zip(a, b.tolist()):
        n = 0
        while n < min(len(row), len(ref)) and row[n] == ref[n]:
            n += 1
        prefix.append(n)
    return {"mean_matching_prefix": sum(prefix) / len(prefix), "rows_identical": sum(p == len(r) for p, r in zip(prefix, a)),
            "first_token_agree": sum(p > 0 for p in prefix) / len(prefix)}


def run(args: argparse.Namespace, device: torch.device) -> dict:
    from benchmarks.gpu.hf_equiv import build_hf_twin, check_equivalence

    moe, _ = presets(args.tiny)
    n, new, plen = (8, 16, 16) if args.tiny else (64, 512, 128)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = init_on_device(moe, device, dtype, seed=0).eval()
    hf = build_hf_twin(model)
    g = torch.Generator().manual_seed(5)
    probe = torch.randint(0, moe.vocab_size, (2, 64), generator=g).to(device)
    res: dict = {"config": {"num_prompts": n, "max_new_tokens": new, "prompt_len": f"[{plen // 2}, {plen}]",
                            "dtype": str(dtype), "sampling": "greedy"},
                 "equivalence": {"bf16_or_run_dtype": check_equivalence(model, hf, probe)}}
    if device.type == "cuda":  # fp32 copies: is it the same function up to rounding?
        m32 = init_on_device(moe, device, torch.float32, seed=0).eval()
        h32 = build_hf_twin(m32, experts_implementation="eager")  # grouped_mm is a bf16 kernel
        res["equivalence"]["fp32"] = check_equivalence(m32, h32, probe)
        del m32, h32
        free_cuda()
    print(f"  equivalence: {res['equivalence']}", flush=True)
    ps = prompts(moe.vocab_size, n, plen, seed=7)
    engine_generate(model, ps, 8)  # warm-up: kernels, allocator
    outs, wall, steps = engine_generate(model, ps, new)
    toks = sum(len(o.output_ids) for o in outs)
    res["engine"] = {"wall_s": wall, "output_tokens": toks, "output_tokens_per_s": toks / wall, "engine_steps": steps,
                     "ms_per_step": 1e3 * wall / max(steps, 1)}
    print(f"  engine: {toks} tokens in {wall:.2f}s = {toks / wall:.0f} tok/s ({res['engine']['ms_per_step']:.1f} ms/step)",
          flush=True)
    res["engine"]["decode_profile"] = decode_profile(model, ps, device)
    variants = [("hf_generate", tm.MASKED_SDPA_BACKENDS if device.type == "cuda" else None)]
    if device.type == "cuda" and not args.skip_hf_default:
        variants.append(("hf_generate_torch_default_sdpa", None))
    for key, backends in variants:
        hf_generate(hf, ps, 8, device, backends)  # warm-up
        hf_out, hf_wall = hf_generate(hf, ps, new, device, backends)
        hf_toks = int(hf_out.numel())
        res[key] = {"wall_s": hf_wall, "output_tokens": hf_toks, "output_tokens_per_s": hf_toks / hf_wall,
                    "experts_implementation": hf.config._experts_implementation,
                    "attn_implementation": hf.config._attn_implementation,
                    "sdpa_backends": str(backends or "torch default (cuDNN first on H200)")}
        res[key]["greedy_match_with_engine"] = match_stats([o.output_ids for o in outs], hf_out)
        print(f"  {key}: {hf_toks} tokens in {hf_wall:.2f}s = {hf_toks / hf_wall:.0f} tok/s; "
              f"greedy match {res[key]['greedy_match_with_engine']}", flush=True)
    res["ratio_engine_over_hf"] = res["engine"]["output_tokens_per_s"] / res["hf_generate"]["output_tokens_per_s"]
    res["greedy_match"] = res["hf_generate"]["greedy_match_with_engine"]
    print(f"  ratio engine / hf generate (same SDPA backends): {res['ratio_engine_over_hf']:.2f}", flush=True)
    if device.type == "cuda":
        res["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    del model, hf
    free_cuda()
    return res
