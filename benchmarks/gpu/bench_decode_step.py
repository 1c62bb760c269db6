"""The static engine's decode step at SmolLM2-135M's shapes: ms per step, and what it launches.

    python -m benchmarks.gpu.bench_decode_step --out DIR              # GPU: 128 rows, CUDA graphs, bf16
    python -m benchmarks.gpu.bench_decode_step --toy --out DIR        # CPU: 2 layers, small vocabulary

Why this measure: in the one-GPU quickstart the engine's decode step sets the pace (issue 45: 6-9 ms
per step for 128 answers, where reading the weights takes under 0.1 ms). A small model's step is
a few hundred tiny kernels replayed as one CUDA graph, so its floor is the kernel count times a
kernel's launch slot (a few microseconds), not FLOPs or bytes. Two numbers, one per cause:

- ``decode_step_ms``: steady-state milliseconds per decode step with ``--rows`` requests running,
  sampled at temperature 1 (the RL setting): the wall time of a batch of ``--long`` new tokens
  minus one of ``--short`` tokens (same prompts, same engine), over the extra steps: prefill,
  admission and the last block's collection cancel out. ``graph_replay_ms``: one replay alone.
  ``batch_fixed_ms``: what the short batch cost besides its decode steps (admission, the eager
  chunked prefill, the first token, the last collection): per batch, not per token, and in an RL
  step of short answers it can weigh as much as the decode steps.
- ``decode_step_ms_sdpa_attention`` (GPU): the same step with SDPA's attention instead of the
  decode-attention kernel (workers/models/blocks/decode_attention.py), measured in the same call.
- ``kernels_per_step`` / ``kernels_per_layer``: the non-view ATen ops one eager decode step
  dispatches (each a kernel on a GPU, counted on any device with a dispatch mode), from two model
  depths so the per-layer and the fixed parts separate. CPU-countable: the test guards them.

Weights are random (a speed measure; SmolLM2-135M's shapes: workers/models/pretrained.py's facts).
Writes ``decode_step.json`` under ``--out``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

#: Ops that make views (no kernel); ``reshape`` counts only when it copies.
VIEW_OPS = {"aten::unsqueeze", "aten::slice", "aten::transpose", "aten::view", "aten::expand", "aten::select",
            "aten::alias", "aten::t", "aten::_unsafe_view", "aten::as_strided", "aten::permute", "aten::squeeze",
            "aten::detach", "aten::split", "aten::split_with_sizes", "aten::unbind"}


class KernelCount(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the dispatched ATen ops that are not views (each a kernel launch on a GPU)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        if name not in VIEW_OPS and not (name == "aten::reshape" and getattr(out, "_base", None) is not None):
            self.n += 1
        return out


def smollm2_config(num_layers: int = 0, vocab_size: int = 0):
    """SmolLM2-135M's LlamaConfig (30 layers, hidden 576, 9 heads / 3 kv heads, vocabulary 49152)."""
    from workers.models.llama.convert import model_config_of

    cfg = model_config_of("smollm2_135m")
    return dataclasses.replace(cfg, num_layers=num_layers or cfg.num_layers, vocab_size=vocab_size or cfg.vocab_size)


def build_engine(cfg, *, rows: int, device: torch.device, dtype: torch.dtype, max_seq_len: int, sync_every: int = 8,
                 start: bool = True):
    from workers.common.registry import MODELS
    from workers.inference.embedded.static_engine import StaticEngine

    lm = MODELS.get("llama").build(cfg, dtype=torch.float32).init_weights(0).to(device=device, dtype=dtype)
    engine = StaticEngine(lm, max_batch_size=rows, seed=0, max_seq_len=max_seq_len, sync_every=sync_every,
                          cuda_graphs=device.type == "cuda")
    return engine.start() if start else engine


def kernels_per_step(engine, rows: int, sample: int) -> int:
    """Non-view ops of one eager decode step over ``rows`` slots (the slots need not be busy)."""
    import workers.models.blocks.kernels as kernels

    fast, kernels.FAST_PATH_ON_CPU = kernels.FAST_PATH_ON_CPU, True  # the ops a GPU runs
    try:
        count = KernelCount()
        with torch.inference_mode(), engine._model_lock, count:
            engine._decode_step(rows, engine._windows[0], sample)
        return count.n
    finally:
        kernels.FAST_PATH_ON_CPU = fast


def kernel_counts(cfg, *, rows: int, device: torch.device, dtype: torch.dtype) -> dict:
    """Kernels per decode step at the config's depth, per layer and outside the layers (two depths: 2 and 4)."""
    from workers.inference.embedded.slot_state import SAMPLE

    counts = {}
    for depth in (2, 4):
        e = build_engine(dataclasses.replace(cfg, num_layers=depth), rows=rows, device=device, dtype=dtype,
                         max_seq_len=512)
        try:
            counts[depth] = kernels_per_step(e, rows, SAMPLE)
        finally:
            e.shutdown()
    per_layer = (counts[4] - counts[2]) / 2
    fixed = counts[2] - 2 * per_layer
    return {"kernels_per_layer": per_layer, "kernels_outside_layers": fixed,
            "kernels_per_step": fixed + cfg.num_layers * per_layer}


def timed_batch(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    from benchmarks.gpu.bench_inference import engine_batch

    _, wall, steps = engine_batch(engine, prompts, new_tokens, temperature=1.0)
    return wall, steps


def steady_step_ms(engine, ps: list[list[int]], args) -> tuple[float, tuple[float, int], tuple[float, int]]:
    """ms per decode step: the median wall of ``args.long`` new tokens minus that of ``args.short`` over the
    extra steps (after a warm-up batch that captures every graph); also each batch's (wall, steps)."""
    timed_batch(engine, ps, args.long)  # warm-up: every graph the measured batches use is captured here
    walls = {}
    for n in (args.short, args.long):
        runs = sorted(timed_batch(engine, ps, n) for _ in range(args.repeats))
        walls[n] = runs[len(runs) // 2]
    (w_s, s_s), (w_l, s_l) = walls[args.short], walls[args.long]
    return 1e3 * (w_l - w_s) / max(s_l - s_s, 1), (w_s, s_s), (w_l, s_l)


def decode_step_ms(cfg, args, device: torch.device, dtype: torch.dtype) -> dict:
    from benchmarks.gpu.bench_inference import graph_step_ms, prompts

    engine = build_engine(cfg, rows=args.rows, device=device, dtype=dtype, max_seq_len=args.max_seq_len)
    try:
        ps = prompts(cfg.vocab_size, args.rows, args.prompt_len, seed=0)
        step_ms, (w_s, s_s), (w_l, s_l) = steady_step_ms(engine, ps, args)
        replay = graph_step_ms(engine, args.rows) if device.type == "cuda" else None
        if getattr(args, "profile", False) and device.type == "cuda":
            from benchmarks.gpu.common import kernel_table
            from benchmarks.gpu.bench_inference import engine_batch
            kernel_table(lambda: engine_batch(engine, ps, args.long, temperature=1.0), "decode batch", rows=40)
        # what a batch costs besides its decode steps: admission, chunked prefill, first token, last collection
        return {"decode_step_ms": step_ms, "graph_replay_ms": replay, "batch_fixed_ms": 1e3 * w_s - s_s * step_ms, "wall_s": {str(args.short): w_s, str(args.long): w_l},
                "decode_steps": {str(args.short): s_s, str(args.long): s_l}, "graph_error": engine.graph_error,
                "cuda_graphs": len(getattr(engine._graphs, "graphs", ()) or ())}
    finally:
        engine.shutdown()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=128, help="requests decoding together (= engine slots)")
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--short", type=int, default=16, help="new tokens of the shorter batch")
    ap.add_argument("--long", type=int, default=48, help="new tokens of the longer batch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-seq-len", type=int, default=2048, help="positions per slot (inference=embedded_gpu's)")
    ap.add_argument("--toy", action="store_true", help="CPU, 2 layers, vocabulary 512, 8 rows: seconds")
    ap.add_argument("--profile", action="store_true", help="GPU: print one batch's kernels by time")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu/local"))
    a = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.toy else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = smollm2_config()
    if a.toy:
        cfg = smollm2_config(num_layers=2, vocab_size=512)
        a.rows, a.prompt_len, a.short, a.long, a.repeats, a.max_seq_len = 8, 8, 4, 12, 1, 256
    t0 = time.perf_counter()
    res = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "shape": "toy" if a.toy else "smollm2_135m", "rows": a.rows, "layers": cfg.num_layers,
           "vocab_size": cfg.vocab_size, "dtype": str(dtype).replace("torch.", "")}
    res.update(kernel_counts(cfg, rows=a.rows, device=device, dtype=dtype))
    res.update(decode_step_ms(cfg, a, device, dtype))
    if device.type == "cuda":  # the same step with SDPA's attention instead of the decode-attention kernel, same call
        from workers.models.blocks import decode_attention

        decode_attention.ENABLED = False
        try:
            res["decode_step_ms_sdpa_attention"] = decode_step_ms(cfg, a, device, dtype)["decode_step_ms"]
        finally:
            decode_attention.ENABLED = True
    res["bench_s"] = time.perf_counter() - t0
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "decode_step.json").write_text(json.dumps(res, indent=1) + "\n")
    replay = f", one graph replay {res['graph_replay_ms']:.3f} ms" if res["graph_replay_ms"] else ""
    print(f"decode step at {res['shape']} ({res['rows']} rows, {res['layers']} layers, {res['device']}): "
          f"{res['decode_step_ms']:.3f} ms{replay} (SDPA attention: {res.get('decode_step_ms_sdpa_attention') or 0:.3f} ms); "
          f"{res['kernels_per_step']:.0f} kernels per step "
          f"({res['kernels_per_layer']:.0f} per layer + {res['kernels_outside_layers']:.0f})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
