"""Embedded engine vs transformers ``generate`` on the same model and weights (issues 11 and 24).

Both decode ``num_prompts`` prompts (lengths spread over [P/2, P], so both pad) for exactly
``max_new_tokens`` tokens each with a KV cache, greedily (so the outputs can be compared token by
token), in bf16 on one GPU, side by side in one run: 64 prompts and 256 prompts x 512 new tokens.
Output tokens/s = prompts x new tokens / wall time from submission to the last token (prefill
included). The engine is the one ``inference.static_cache=auto`` picks on a GPU: the static engine
(fixed KV slots, decode steps as CUDA graphs: workers/inference/embedded/static_engine.py), started
and warmed up (graphs captured) before the clock starts; the dynamic engine (the CPU default) is
measured too at the first prompt count, for the before/after. The HF twin is Qwen3MoeForCausalLM
(benchmarks/gpu/hf_equiv.py: q/k norms replaced by identity, experts fused); its logits are
checked against tiny_moe's on the same input first.

Standalone, without hydra: ``python3 -m benchmarks.gpu.bench_inference --out DIR`` writes
``DIR/inference.json`` (``--tiny``: small shapes, runs on CPU in seconds).
"""
from __future__ import annotations

import argparse
import threading
import time

import torch
from torch.nn.attention import sdpa_kernel

import workers.models.blocks.kernels as tm
from benchmarks.gpu.common import free_cuda, init_on_device, presets, sync
from workers.inference.embedded.static_engine import StaticEngine
from workers.inference.embedded.engine import GenRequest, InferenceEngine


def prompts(vocab: int, n: int, max_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(max_len // 2, max_len + 1, (n,), generator=g)
    return [torch.randint(4, vocab, (int(l),), generator=g).tolist() for l in lens]


def make_engine(model, kind: str, num_prompts: int, max_len: int, seed: int = 0):
    """A started engine: ``static`` (CUDA graphs on a GPU) or ``dynamic``, ``num_prompts`` slots."""
    if kind == "dynamic":
        return InferenceEngine(model, max_batch_size=num_prompts, seed=seed).start()
    return StaticEngine(model, max_batch_size=num_prompts, seed=seed, max_seq_len=max_len, prefill_chunk=512,
                        sync_every=8).start()


def engine_batch(engine, ps: list[list[int]], new_tokens: int, *, temperature: float = 0.0,
                 routed: bool = False, timeout_s: float = 900.0):
    """One batch through a started engine: all requests queued while it is paused, so the first
    step admits them together, as transformers' generate takes them."""
    outs, done = {}, threading.Semaphore(0)
    reqs = [GenRequest(input_ids=p, temperature=temperature, max_new_tokens=new_tokens, return_routed_experts=routed)
            for p in ps]
    engine.pause()
    for r in reqs:
        engine.submit(r, lambda o: (outs.__setitem__(o.rid, o), done.release()))
    steps0 = engine.num_steps
    sync(engine.device)
    t0 = time.perf_counter()
    engine.resume()
    deadline = time.monotonic() + timeout_s
    for _ in reqs:
        if not done.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"engine finished {len(outs)}/{len(reqs)} requests in {timeout_s}s")
    wall = time.perf_counter() - t0
    if engine.error is not None:
        raise engine.error
    return [outs[r.rid] for r in reqs], wall, engine.num_steps - steps0


def engine_generate(model, ps: list[list[int]], new_tokens: int, *, temperature: float = 0.0,
                    routed: bool = False, seed: int = 0, timeout_s: float = 900.0):
    """One batch through a fresh dynamic engine (router-replay benchmark, GPU smoke test)."""
    engine = make_engine(model, "dynamic", len(ps), 0, seed)
    try:
        outs, wall, steps = engine_batch(engine, ps, new_tokens, temperature=temperature, routed=routed,
                                         timeout_s=timeout_s)
    finally:
        engine.shutdown()
    return outs, wall, steps


def graph_step_ms(engine, n: int, iters: int = 20):
    """GPU time of one greedy decode-graph replay at ``n`` rows over the whole KV slot (the longest
    key window; every slot idle, so replays only touch scratch)."""
    graphs = getattr(engine, "_graphs", None)
    if graphs is None:
        return None
    key = (next(b for b in engine._sizes if b >= n), engine._windows[-1], False)
    with engine._model_lock:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graphs.run(key)
        start.record()
        for _ in range(iters):
            graphs.run(key)
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / iters


def engine_run(model, kind: str, ps: list[list[int]], new_tokens: int, max_len: int) -> tuple[dict, list]:
    engine = make_engine(model, kind, len(ps), max_len)
    try:
        t0 = time.perf_counter()
        engine_batch(engine, ps[:8], 8)  # warm-up: graph capture, kernels, allocator
        warm = time.perf_counter() - t0
        outs, wall, steps = engine_batch(engine, ps, new_tokens)
        replay_ms = graph_step_ms(engine, len(ps))
    finally:
        engine.shutdown()
    toks = sum(len(o.output_ids) for o in outs)
    res = {"kind": type(engine).__name__, "wall_s": wall, "output_tokens": toks, "output_tokens_per_s": toks / wall,
           "decode_steps": steps, "ms_per_step": 1e3 * wall / max(steps, 1), "warmup_s": warm,
           "graph_replay_ms_per_step": replay_ms, "cuda_graphs": len(getattr(getattr(engine, "_graphs", None), "graphs", ())),
           "graph_error": getattr(engine, "graph_error", None)}
    print(f"  {kind} engine, {len(ps)} prompts: {toks} tokens in {wall:.2f}s = {toks / wall:.0f} tok/s "
          f"({res['ms_per_step']:.2f} ms/step; warm-up incl. graph capture {warm:.1f}s)", flush=True)
    return res, outs


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


def hf_run(hf, ps: list[list[int]], new_tokens: int, device, backends) -> tuple[dict, torch.Tensor]:
    hf_generate(hf, ps[:8], 8, device, backends)  # warm-up
    out, wall = hf_generate(hf, ps, new_tokens, device, backends)
    toks = int(out.numel())
    res = {"wall_s": wall, "output_tokens": toks, "output_tokens_per_s": toks / wall,
           "experts_implementation": hf.config._experts_implementation,
           "attn_implementation": hf.config._attn_implementation,
           "sdpa_backends": str(backends or "torch default (cuDNN first on H200)")}
    print(f"  hf generate, {len(ps)} prompts: {toks} tokens in {wall:.2f}s = {toks / wall:.0f} tok/s", flush=True)
    return res, out


def run(args: argparse.Namespace, device: torch.device) -> dict:
    from benchmarks.gpu.hf_equiv import build_hf_twin, check_equivalence

    moe, _ = presets(args.tiny)
    counts = (8, 32) if args.tiny else tuple(getattr(args, "prompt_counts", (64, 256)))
    new, plen = (16, 16) if args.tiny else (getattr(args, "new_tokens", 512), 128)
    max_len = -(-(plen + new + 1) // 64) * 64  # a KV slot: the longest prompt + every new token
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = init_on_device(moe, device, dtype, seed=0).eval()
    hf = build_hf_twin(model)
    g = torch.Generator().manual_seed(5)
    probe = torch.randint(0, moe.vocab_size, (2, 64), generator=g).to(device)
    res: dict = {"config": {"prompt_counts": list(counts), "max_new_tokens": new, "prompt_len": f"[{plen // 2}, {plen}]",
                            "dtype": str(dtype), "sampling": "greedy", "static_max_seq_len": max_len},
                 "equivalence": {"bf16_or_run_dtype": check_equivalence(model, hf, probe)}, "runs": []}
    print(f"  equivalence: {res['equivalence']}", flush=True)
    backends = tm.MASKED_SDPA_BACKENDS if device.type == "cuda" else None
    for i, n in enumerate(counts):
        ps = prompts(moe.vocab_size, n, plen, seed=7)
        row: dict = {"num_prompts": n}
        row["engine"], outs = engine_run(model, "static", ps, new, max_len)
        if i == 0 and not getattr(args, "skip_dynamic", False):
            row["engine_dynamic"], dyn = engine_run(model, "dynamic", ps, new, max_len)
            row["static_vs_dynamic_greedy"] = match_stats([o.output_ids for o in outs], torch.tensor([o.output_ids for o in dyn]))
        row["hf_generate"], hf_out = hf_run(hf, ps, new, device, backends)
        row["greedy_match"] = match_stats([o.output_ids for o in outs], hf_out)
        row["ratio_engine_over_hf"] = row["engine"]["output_tokens_per_s"] / row["hf_generate"]["output_tokens_per_s"]
        if "engine_dynamic" in row:
            row["ratio_dynamic_engine_over_hf"] = (row["engine_dynamic"]["output_tokens_per_s"]
                                                   / row["hf_generate"]["output_tokens_per_s"])
        print(f"  {n} prompts: ratio engine / hf generate (same SDPA backends) {row['ratio_engine_over_hf']:.2f}; "
              f"greedy match {row['greedy_match']}", flush=True)
        res["runs"].append(row)
        free_cuda()
    first = res["runs"][0]
    res.update(engine=first["engine"], hf_generate=first["hf_generate"], greedy_match=first["greedy_match"],
               ratio_engine_over_hf=first["ratio_engine_over_hf"],
               ratio_engine_over_hf_by_prompts={str(r["num_prompts"]): r["ratio_engine_over_hf"] for r in res["runs"]})
    if device.type == "cuda":
        res["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    del model, hf
    free_cuda()
    return res


def main(argv=None) -> int:
    from pathlib import Path

    from benchmarks.gpu.common import device_info, write_result

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/out/gpu/latest", help="directory for inference.json")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (runs on CPU in seconds)")
    ap.add_argument("--prompt-counts", default="64,256", help="comma list of batch sizes")
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--skip-dynamic", action="store_true", help="do not time the dynamic engine")
    args = ap.parse_args(argv)
    args.prompt_counts = tuple(int(x) for x in args.prompt_counts.split(","))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    res = {"device_info": device_info(), "inference": run(args, device)}
    print(f"wrote {write_result(Path(args.out), 'inference', res)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
