"""FP8 rollouts against bf16 in the static engine: decode tokens/s on the same prompts, and each one's mismatch KL.

    python -m benchmarks.gpu.bench_fp8_decode --out DIR          # GPU: SmolLM2-135M's shapes and a qwen3_moe, 128 rows
    python -m benchmarks.gpu.bench_fp8_decode --toy --out DIR    # CPU: tiny shapes through the same code

Per shape, one bf16 model (random weights, the same for both engines) serves twice in one run: as it is
(``inference.dtype=bfloat16``) and as a deep copy swapped to fp8 (workers/inference/embedded/fp8.py,
``inference.dtype=float8``). For each engine:

- ``decode_tokens_per_s``: rows x 1000 / the steady-state decode step (benchmarks/gpu/bench_decode_step.py's
  measure: a batch of ``--long`` new tokens minus one of ``--short``, same prompts, sampled at temperature 1);
- ``mismatch_kl``: the trainer's ``mismatch_kl`` (mean k3 = r - log r - 1, r = p_trainer / p_engine, over the
  sampled tokens: workers/trainer/loss.py) of the engine's sampled-token logprobs against a full bf16
  forward of the unquantized model over prompt + answer (what the trainer scores with).

``engine_fp8_over_bf16`` is the fp8 engine's tokens/s over bf16's. Shapes: ``smollm2_135m`` (hidden 576:
per-row scales, tiny GEMMs: the step is launch-bound, fp8 adds its activation-quantize kernels and may
lose) and ``qwen3_moe`` (Qwen3-30B-A3B's layer: hidden 2048, 128 experts of width 768, top 8, 32/4 heads of
128; ``--moe-layers`` of them): where the step reads GBs of expert weights and fp8 halves them.
Random weights give near-uniform next-token distributions, so both KLs are small in absolute terms;
compare them with each other. Writes ``fp8_decode.json`` under ``--out``.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import time
from pathlib import Path

import torch

from benchmarks.gpu.bench_decode_step import smollm2_config, steady_step_ms

HEADLINE = "qwen3_moe"
"""The shape ``engine_fp8_over_bf16`` reports (the issue's claim is for MoE); every shape's ratio is in its row."""


def moe_config(layers: int, toy: bool):
    from workers.models.qwen3_moe.config import Qwen3MoeConfig

    if toy:
        return Qwen3MoeConfig(vocab_size=384, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                              num_experts=4, top_k=2, expert_intermediate_size=128, max_position_embeddings=512)
    return Qwen3MoeConfig(vocab_size=32768, hidden_size=2048, num_layers=layers, num_heads=32, num_kv_heads=4,
                          head_dim=128, num_experts=128, top_k=8, expert_intermediate_size=768,
                          max_position_embeddings=4096)


@torch.no_grad()
def random_model(family: str, cfg, device: torch.device, seed: int = 0):
    """bf16 model with N(0, 0.02) weights drawn on ``device`` (a CPU init of the MoE's 2.4B would take minutes)."""
    from workers.common.registry import MODELS

    lm = MODELS.get(family).build(cfg, device=device, dtype=torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in lm.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    return lm.eval()


def k3_mismatch(ref, outs, prompts, device: torch.device, chunk: int = 16) -> float:
    """Mean k3 of the engine's sampled-token logprobs against ``ref``'s full forward (the trainer's view)."""
    k3, n = 0.0, 0
    with torch.inference_mode():
        for i in range(0, len(outs), chunk):
            group = list(zip(prompts[i:i + chunk], outs[i:i + chunk]))
            width = max(len(p) + len(o.output_ids) for p, o in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)
            for r, (p, o) in enumerate(group):
                ids[r, :len(p) + len(o.output_ids)] = torch.tensor(p + o.output_ids)
            logp = ref(ids.to(device)).logits.float().log_softmax(-1)
            for r, (p, o) in enumerate(group):
                t = torch.tensor(o.output_ids, device=device)
                train = logp[r, len(p) - 1:len(p) - 1 + len(t)].gather(1, t[:, None]).squeeze(1)
                log_r = train - torch.tensor(o.logprobs, device=device)
                k3 += float((log_r.exp() - log_r - 1).sum())
                n += len(t)
    return k3 / max(n, 1)


def measure(model, ref, ps, args, device) -> dict:
    """Decode tokens/s and mismatch KL of a static engine serving ``model``."""
    from benchmarks.gpu.bench_inference import engine_batch
    from workers.inference.embedded.static_engine import StaticEngine

    engine = StaticEngine(model, max_batch_size=args.rows, seed=0, max_seq_len=args.max_seq_len,
                          cuda_graphs=device.type == "cuda").start()
    try:
        step_ms = steady_step_ms(engine, ps, args)[0]
        outs, _, _ = engine_batch(engine, ps, args.long, temperature=1.0)
        return {"decode_step_ms": step_ms, "decode_tokens_per_s": args.rows * 1e3 / step_ms,
                "mismatch_kl": k3_mismatch(ref, outs, ps, device), "graph_error": engine.graph_error}
    finally:
        engine.shutdown()


def shape_row(name: str, family: str, cfg, args, device: torch.device) -> dict:
    from benchmarks.gpu.bench_inference import prompts
    from workers.inference.embedded.fp8 import quantize_model

    t0 = time.perf_counter()
    ref = random_model(family, cfg, device)
    ps = prompts(cfg.vocab_size, args.rows, args.prompt_len, seed=0)
    bf16 = measure(ref, ref, ps, args, device)
    fp8_model = copy.deepcopy(ref)
    report = quantize_model(fp8_model)
    fp8 = measure(fp8_model, ref, ps, args, device)
    del fp8_model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print(f"{name}: bf16 {bf16['decode_tokens_per_s']:.0f} tok/s (KL {bf16['mismatch_kl']:.2e}), fp8 "
          f"{fp8['decode_tokens_per_s']:.0f} tok/s (KL {fp8['mismatch_kl']:.2e}): "
          f"{fp8['decode_tokens_per_s'] / bf16['decode_tokens_per_s']:.2f}x", flush=True)
    return {"shape": name, "family": family, "layers": cfg.num_layers, "hidden": cfg.hidden_size,
            "params": sum(p.numel() for p in ref.parameters()), "bf16": bf16, "fp8": fp8, "fp8_swap": report,
            "fp8_over_bf16": fp8["decode_tokens_per_s"] / bf16["decode_tokens_per_s"],
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=128, help="requests decoding together (= engine slots)")
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--long", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--moe-layers", type=int, default=4, help="qwen3_moe layers at Qwen3-30B-A3B's widths")
    ap.add_argument("--shapes", default="smollm2_135m,qwen3_moe")
    ap.add_argument("--toy", action="store_true", help="CPU, tiny shapes, 4 rows: seconds")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu/local"))
    a = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.toy else "cpu")
    if a.toy:
        a.rows, a.prompt_len, a.short, a.long, a.repeats, a.max_seq_len = 4, 8, 3, 8, 1, 64
    shapes = {"smollm2_135m": ("llama", smollm2_config(num_layers=2, vocab_size=512) if a.toy else smollm2_config()),
              "qwen3_moe": ("qwen3_moe", moe_config(a.moe_layers, a.toy))}
    res = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "rows": a.rows, "new_tokens": [a.short, a.long], "rows_by_shape": []}
    for name in a.shapes.split(","):
        family, cfg = shapes[name]
        res["rows_by_shape"].append(shape_row(name, family, dataclasses.replace(cfg), a, device))
    by = {r["shape"]: r for r in res["rows_by_shape"]}
    best = by.get(HEADLINE) or res["rows_by_shape"][0]  # a fixed shape, not the best of them
    res.update(engine_fp8_over_bf16=best["fp8_over_bf16"], engine_fp8_shape=best["shape"],
               fp8_mismatch_kl=best["fp8"]["mismatch_kl"], bf16_mismatch_kl=best["bf16"]["mismatch_kl"])
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "fp8_decode.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
