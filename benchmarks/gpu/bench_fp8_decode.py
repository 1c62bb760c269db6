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

``engine_fp8_over_bf16`` is the fp8 engine's tokens/s over bf16's for ``qwen3_moe`` at ``--moe-layers``
(``engine_fp8_layers``). Shapes: ``smollm2_135m`` (hidden 576: per-row scales, tiny GEMMs: the step is
launch-bound, fp8 adds its activation-quantize kernels and may lose) and ``qwen3_moe`` (Qwen3-30B-A3B's
layer: hidden 2048, 128 experts of width 768, top 8, 32/4 heads of 128): the step reads 1.2 GB of bf16
expert weights per layer and fp8 halves them. Depth: the default 16 layers is what one 80 GB card holds
with both engines' weights resident (20 GB bf16 + 10 GB fp8); at 4 layers the fixed per-step costs
(embedding, LM head, sampling, launch) hide the per-layer gain. ``qwen3_moe_per_layer`` is the slope
between ``--shallow-layers`` and ``--moe-layers`` (ms per layer for each engine, their ratio, and both
step times projected to the real model's 48 layers). ``fp8_swap.block_reason`` says whether the
blockwise (128x128) start-up check passed, and why not.
Random weights give near-uniform next-token distributions, so both KLs are small in absolute terms;
compare them with each other. Writes ``fp8_decode.json`` under ``--out``.
"""
from __future__ import annotations

import argparse
import contextlib
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


def measure(model, ps, args, device, ref=None) -> dict:
    """Decode tokens/s of a static engine serving ``model``, and its mismatch KL against ``ref`` (a context
    manager giving the bf16 model: the trainer's view), computed after the engine stopped."""
    from benchmarks.gpu.bench_inference import engine_batch
    from workers.inference.embedded.static_engine import StaticEngine

    engine = StaticEngine(model, max_batch_size=args.rows, seed=0, max_seq_len=args.max_seq_len,
                          cuda_graphs=device.type == "cuda").start()
    try:
        step_ms = steady_step_ms(engine, ps, args)[0]
        outs, _, _ = engine_batch(engine, ps, args.long, temperature=1.0)
        if args.profile and device.type == "cuda":
            from benchmarks.gpu.common import kernel_table

            kernel_table(lambda: engine_batch(engine, ps, args.long, temperature=1.0),
                         f"{'fp8' if ref is not None else 'bf16'} engine, one batch of {args.long} new tokens")
        graph_error = engine.graph_error
    finally:
        engine.shutdown()
    with (ref or contextlib.nullcontext)(model) as bf16:
        kl = k3_mismatch(bf16, outs, ps, device)
    return {"decode_step_ms": step_ms, "decode_tokens_per_s": args.rows * 1e3 / step_ms, "mismatch_kl": kl,
            "graph_error": graph_error}


def shape_row(name: str, family: str, cfg, args, device: torch.device) -> dict:
    """bf16 then fp8 on ONE resident model: fp8 quantizes it in place (bf16 parameters + fp8 copies =
    1.5x the projections' bytes, what a serving engine holds) and ``bf16_forward`` gives the reference."""
    from benchmarks.gpu.bench_inference import prompts
    from workers.inference.embedded.fp8 import bf16_forward, quantize_model

    t0 = time.perf_counter()
    model = random_model(family, cfg, device)
    ps = prompts(cfg.vocab_size, args.rows, args.prompt_len, seed=0)
    params = sum(p.numel() for p in model.parameters())
    bf16 = measure(model, ps, args, device)
    report = quantize_model(model)
    fp8 = measure(model, ps, args, device, ref=bf16_forward)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print(f"{name} ({cfg.num_layers} layers): bf16 {bf16['decode_tokens_per_s']:.0f} tok/s (KL {bf16['mismatch_kl']:.2e}), "
          f"fp8 {fp8['decode_tokens_per_s']:.0f} tok/s (KL {fp8['mismatch_kl']:.2e}): "
          f"{fp8['decode_tokens_per_s'] / bf16['decode_tokens_per_s']:.2f}x; block scales: {report['block_reason']}",
          flush=True)
    return {"shape": name, "family": family, "layers": cfg.num_layers, "hidden": cfg.hidden_size, "params": params,
            "bf16": bf16, "fp8": fp8, "fp8_swap": report,
            "fp8_over_bf16": fp8["decode_tokens_per_s"] / bf16["decode_tokens_per_s"],
            "seconds": round(time.perf_counter() - t0, 1)}


def per_layer(shallow: dict, deep: dict, project_to: int = 48) -> dict:
    """The decode step's cost per layer (the slope between two depths of the same widths), its fixed part
    (embedding, LM head, sampling, launch) and the ratio the slope converges to at ``project_to`` layers
    (Qwen3-30B-A3B has 48): what a full-depth model would show, measured without holding one."""
    dl = deep["layers"] - shallow["layers"]
    out = {"depths": [shallow["layers"], deep["layers"]], "projected_layers": project_to}
    for eng in ("bf16", "fp8"):
        slope = (deep[eng]["decode_step_ms"] - shallow[eng]["decode_step_ms"]) / dl
        fixed = deep[eng]["decode_step_ms"] - slope * deep["layers"]
        out[eng] = {"ms_per_layer": slope, "fixed_ms": fixed, "projected_step_ms": fixed + slope * project_to}
    out["per_layer_fp8_over_bf16"] = out["bf16"]["ms_per_layer"] / out["fp8"]["ms_per_layer"]
    out["projected_fp8_over_bf16"] = out["bf16"]["projected_step_ms"] / out["fp8"]["projected_step_ms"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=128, help="requests decoding together (= engine slots)")
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--long", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--moe-layers", type=int, default=16,
                    help="qwen3_moe layers at Qwen3-30B-A3B's widths (16: ~20 GB bf16 + 10 GB fp8, one 80 GB card)")
    ap.add_argument("--shallow-layers", type=int, default=4,
                    help="a second, shallower qwen3_moe: the per-layer slope between the two depths (0: skip)")
    ap.add_argument("--shapes", default="smollm2_135m,qwen3_moe")
    ap.add_argument("--toy", action="store_true", help="CPU, tiny shapes, 4 rows: seconds")
    ap.add_argument("--profile", action="store_true", help="GPU: print each engine's kernels by time (one batch)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu/local"))
    a = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.toy else "cpu")
    if a.toy:
        a.rows, a.prompt_len, a.short, a.long, a.repeats, a.max_seq_len = 4, 8, 3, 8, 1, 64
        a.moe_layers, a.shallow_layers = 2, min(a.shallow_layers, 1)
    if a.shallow_layers >= a.moe_layers:
        ap.error(f"--shallow-layers must be below --moe-layers ({a.moe_layers}), got {a.shallow_layers}")
    shapes = {"smollm2_135m": ("llama", smollm2_config(num_layers=2, vocab_size=512) if a.toy else smollm2_config()),
              "qwen3_moe": ("qwen3_moe", moe_config(a.moe_layers, a.toy))}
    res = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "rows": a.rows, "new_tokens": [a.short, a.long], "rows_by_shape": []}
    for name in a.shapes.split(","):
        family, cfg = shapes[name]
        if name == "qwen3_moe" and a.shallow_layers:
            shallow = shape_row(name, family, dataclasses.replace(cfg, num_layers=a.shallow_layers), a, device)
            res["qwen3_moe_shallow"] = shallow
        res["rows_by_shape"].append(shape_row(name, family, dataclasses.replace(cfg), a, device))
        if name == "qwen3_moe" and a.shallow_layers:
            res["qwen3_moe_per_layer"] = slope = per_layer(shallow, res["rows_by_shape"][-1])
            print(f"qwen3_moe per layer: bf16 {slope['bf16']['ms_per_layer']:.3f} ms, fp8 {slope['fp8']['ms_per_layer']:.3f} ms "
                  f"({slope['per_layer_fp8_over_bf16']:.2f}x); at {slope['projected_layers']} layers "
                  f"{slope['projected_fp8_over_bf16']:.2f}x", flush=True)
    by = {r["shape"]: r for r in res["rows_by_shape"]}
    best = by.get(HEADLINE) or res["rows_by_shape"][0]  # a fixed shape, not the best of them
    res.update(engine_fp8_over_bf16=best["fp8_over_bf16"], engine_fp8_shape=best["shape"],
               engine_fp8_layers=best["layers"], fp8_block_reason=best["fp8_swap"]["block_reason"],
               fp8_mismatch_kl=best["fp8"]["mismatch_kl"], bf16_mismatch_kl=best["bf16"]["mismatch_kl"])
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "fp8_decode.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
