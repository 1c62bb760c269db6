"""One GLM-5 attention layer (MLA + DSA indexer + sparse attention) at its real shapes: time, FLOP
utilization and memory at 32k and 131k tokens, the torch path and the fused Triton kernel side by side.

    python3 -m benchmarks.gpu.bench_dsa_layer --out DIR                 # CUDA (H100 / H200), ~3 min
    python3 -m benchmarks.gpu.bench_dsa_layer --out DIR --smoke         # CPU, tiny: the same code path

Why: benchmarks/long_context_dsa.py shows DSA's memory stays linear, on a GLM-5 of hidden size 64;
it says nothing about speed at GLM-5's layer (issue 45 item 4). Here: transformers' GlmMoeDsaConfig
numbers (hidden 6144, 64 heads, q_lora 2048, MLA latent 512 + rope 64, qk_nope 192, v 256, 32 index
heads of 128, top-2048), our model code (workers/models/blocks/mla.py, dsa_indexer.py, dsa_sparse.py),
bf16 random weights, one row of T tokens, the model's query chunks. Per T and path
(``model.dsa_attention_kernel`` torch | auto = fused, workers/models/blocks/dsa_fused.py), CUDA events:

* ``layer``: the layer's forward + backward (gradients of its weights and input), indexer included;
* ``attention``: the sparse attention alone (absorption, the K-key softmax, un-absorption; chunks
  under activation checkpointing as in the model), forward + backward, for the same chosen keys;
* ``indexer``: the key choice alone (forward only: it gets no gradient), once per T.

FLOPs are counted per part (:func:`flops`), model FLOPs only (a recomputed forward is not counted):
projections (trainable: x3 for forward + backward), absorption, the sparse attention over
``sum_i min(K, i + 1)`` (query, key) pairs at ``2 x H x (576 + 512)`` a pair (x3), the indexer's
projections and its dense causal scoring ``2 x 32 x 128 x T(T+1)/2`` (forward only; bf16 tensor-core
dots with float32 sums in the bf16 model, workers/models/blocks/dsa_kernels.py: the bf16 peak is its
ceiling; its utilization of the float32 peak is reported beside, for float32 runs). Utilization = FLOPs / time /
the card's dense peak (common.py ``peak_flops``). Peak memory: ``max_memory_allocated`` during the
layer's step minus what was allocated before. Writes ``DIR/dsa_layer.json``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.gpu.common import device_info, free_cuda, peak_flops
from workers.models.blocks import dsa_sparse
from workers.models.blocks.decoder import ForwardContext
from workers.models.blocks.dsa_fused import fused_applies
from workers.models.deepseek_v3.config import rope_of
from workers.models.glm_moe_dsa.config import GlmMoeDsaConfig
from workers.models.glm_moe_dsa.model import make_dsa_attention

GLM5 = GlmMoeDsaConfig(
    name="glm5_layer", vocab_size=154880, hidden_size=6144, num_layers=1, num_heads=64, q_lora_rank=2048,
    kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, num_indexer_heads=32,
    indexer_head_dim=128, index_topk=2048, max_position_embeddings=202752, num_experts=256, top_k=8,
    expert_intermediate_size=2048, num_shared_experts=1, num_dense_layers=3, dense_intermediate_size=12288)
"""GLM-5's attention shapes (transformers' GlmMoeDsaConfig defaults); only layer 0's attention is built."""

TINY = dataclasses.replace(GLM5, hidden_size=64, num_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                           qk_rope_head_dim=8, v_head_dim=16, num_indexer_heads=2, indexer_head_dim=16, index_topk=16)
"""--smoke: the same layer kinds at CPU size."""

PATHS = {"torch": "torch", "fused": "auto"}
"""Row name -> model.dsa_attention_kernel."""


def sparse_pairs(t: int, k: int) -> int:
    """(query, key) pairs the causal sparse attention scores: query i sees min(k, i + 1) keys."""
    head = min(t, k)
    return head * (head + 1) // 2 + max(t - k, 0) * k


def flops(cfg: GlmMoeDsaConfig, t: int) -> dict[str, float]:
    """Model FLOPs of one layer's forward + backward on one row of ``t`` tokens, by part."""
    h, nh, r, dr = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    dn, dv, ql, ih, idim = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.q_lora_rank, cfg.num_indexer_heads, \
        cfg.indexer_head_dim
    proj = h * ql + ql * nh * (dn + dr) + h * (r + dr) + nh * dv * h  # q_a, q_b, kv_a, o_proj (kv_b: absorbed)
    absorb = nh * dn * r + nh * r * dv  # q_nope W_uk, out W_uv per token
    out = {"projections": 6.0 * proj * t, "absorption": 6.0 * absorb * t,
           "sparse_attention": 3.0 * 2 * nh * ((r + dr) + r) * sparse_pairs(t, cfg.index_topk),
           "indexer_projections": 2.0 * (ql * ih * idim + h * idim + h * ih) * t,
           "indexer_scoring": 2.0 * ih * idim * t * (t + 1) / 2}
    out["total"] = sum(out.values())
    return out


def build(cfg: GlmMoeDsaConfig, device, dtype):
    """Layer 0's attention (with its indexer), random normal(0, init_std) weights drawn on ``device``."""
    with torch.device("meta"):
        attn = make_dsa_attention(cfg, 0)
    attn = attn.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if "norm" in name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                p.normal_(0.0, cfg.init_std, generator=gen)
    return attn.to(dtype)


class Timer:
    """Seconds of ``fn()`` per run: CUDA events on CUDA, perf_counter on CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, warmup: int, iters: int) -> list[float]:
        for _ in range(warmup):
            fn()
        out = []
        for _ in range(iters):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                out.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
        return out


def measure_t(attn, cfg, t: int, paths: list[str], device, dtype, timer, warmup: int, iters: int) -> list[dict]:
    """Rows (one per path) at ``t`` tokens, plus the indexer's own time in each."""
    cuda = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(t)
    pos = torch.arange(t, device=device)[None]
    cos, sin = rope_of(cfg).cos_sin(pos, dtype)
    x = torch.randn(1, t, cfg.hidden_size, device=device, dtype=dtype, generator=gen).requires_grad_()
    gy = torch.randn(1, t, cfg.hidden_size, device=device, dtype=dtype, generator=gen)

    def ctx():
        return ForwardContext(position_ids=pos, valid=torch.ones(1, t, dtype=torch.bool, device=device), mask=None,
                              cache=None, past=0)

    with torch.no_grad():  # the sparse attention's own inputs, as the layer makes them
        q_latent = attn.q_a_layernorm(attn.q_a_proj(x))
        chosen = attn.indexer.choose(x, q_latent, cos, sin, ctx(), attn.dsa_chunk)
    indexer_s = timer(lambda: attn.indexer.choose(x, q_latent, cos, sin, ctx(), attn.dsa_chunk), warmup, iters)
    nh, dn, dr, r = attn.nh, attn.dn, attn.dr, attn.r
    q_nope = torch.randn(1, nh, t, dn, device=device, dtype=dtype, generator=gen).requires_grad_()
    q_rot = torch.randn(1, nh, t, dr, device=device, dtype=dtype, generator=gen).requires_grad_()
    entry = torch.randn(1, t, r + dr, device=device, dtype=dtype, generator=gen).requires_grad_()
    w = attn.kv_b_proj.weight.detach().view(nh, dn + attn.dv, r)
    g_attn = torch.randn(1, nh, t, attn.dv, device=device, dtype=dtype, generator=gen)
    rows = {}
    for path in paths:  # the attention alone first, then its inputs go: the layer's step has the card to itself
        if path == "fused" and not fused_applies(x):
            rows[path] = {"seq_len": t, "path": path, "skipped": "the Triton kernel needs CUDA (or TRITON_INTERPRET=1)"}
            continue
        fused, rows[path] = path == "fused", {"seq_len": t, "path": path}

        def attention():
            dsa_sparse.attend_latent(q_nope, q_rot, entry, w, chosen, attn.scale, attn.dsa_chunk, fused).backward(g_attn)

        guarded(rows[path], "attention_s", lambda: timer(attention, warmup, iters))
        q_nope.grad = q_rot.grad = entry.grad = None
    del q_nope, q_rot, entry, g_attn, chosen, q_latent
    free_cuda()
    for path, row in rows.items():
        if "skipped" in row:
            continue
        attn.dsa_kernel = PATHS[path]

        def layer():
            attn(x, cos, sin, ctx()).backward(gy)

        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        guarded(row, "layer_s", lambda: timer(layer, warmup, iters))
        row["peak_bytes"] = (torch.cuda.max_memory_allocated() - base) if cuda else None
        for p in (x, *attn.parameters()):
            p.grad = None
        free_cuda()
    for row in rows.values():
        row.update(indexer_s=indexer_s, flops=flops(cfg, t))
    return list(rows.values())


def guarded(row: dict, key: str, run) -> None:
    """``row[key] = run()``; a failure (out of memory, a kernel that does not compile) becomes the row's error."""
    if "error" in row:
        return
    try:
        row[key] = run()
    except Exception as e:  # noqa: BLE001 - reported in the row and the table, the other rows still run
        row["error"] = f"{key}: {type(e).__name__}: {str(e)[:400]}"
        free_cuda()


def utilization(row: dict, peak_bf16: float | None, peak_fp32: float | None) -> dict:
    """Median seconds and FLOP utilization of each timed part."""
    if "layer_s" not in row or "attention_s" not in row:
        return row
    f = row["flops"]
    med = {k: statistics.median(row[k]) for k in ("layer_s", "attention_s", "indexer_s")}
    row.update({f"{k}_median": v for k, v in med.items()})
    attn = f["sparse_attention"] + f["absorption"]
    row["tflops"] = {"layer": f["total"] / med["layer_s"] / 1e12, "attention": attn / med["attention_s"] / 1e12,
                     "indexer": (f["indexer_scoring"] + f["indexer_projections"]) / med["indexer_s"] / 1e12}
    if peak_bf16:
        row["utilization"] = {k: v * 1e12 / peak_bf16 for k, v in row["tflops"].items()}
        row["indexer_utilization_fp32_peak"] = row["tflops"]["indexer"] * 1e12 / peak_fp32 if peak_fp32 else None
    return row


def table(rows: list[dict], device: str, dtype: str = "bfloat16") -> str:
    head = (f"{'T':>7} {'path':>6} {'layer s':>8} {'util':>6} {'attn s':>7} {'attn TF/s':>9} {'util':>6} "
            f"{'indexer s':>9} {'idx TF/s':>8} {'peak GiB':>8}")
    lines = [f"one GLM-5 attention layer, forward + backward, {dtype}, on {device}:", head]
    for r in rows:
        if "layer_s_median" not in r:
            lines.append(f"{r['seq_len']:>7} {r['path']:>6}  {r.get('skipped') or r.get('error')}")
            continue
        u = r.get("utilization") or {}
        pct = lambda k: f"{100 * u[k]:5.1f}%" if k in u else "   n/a"  # noqa: E731
        peak = f"{r['peak_bytes'] / 2**30:8.1f}" if r.get("peak_bytes") is not None else "     n/a"
        lines.append(f"{r['seq_len']:>7} {r['path']:>6} {r['layer_s_median']:8.3f} {pct('layer')} "
                     f"{r['attention_s_median']:7.3f} {r['tflops']['attention']:9.1f} {pct('attention')} "
                     f"{r['indexer_s_median']:9.3f} {r['tflops']['indexer']:8.1f} {peak}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=None, help="default 32768 131072 (--smoke: 48 96)")
    ap.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS))
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs of each part at the FIRST length only")
    ap.add_argument("--iters", type=int, default=2, help="timed runs at lengths <= 32768")
    ap.add_argument("--long-iters", type=int, default=1, help="timed runs above 32768 tokens")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (float32): the whole path in seconds")
    a = ap.parse_args(argv)
    device = torch.device("cpu" if a.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --smoke on CPU")
    cfg, dtype = (TINY, torch.float32) if a.smoke else (GLM5, torch.bfloat16)
    seq_lens = a.seq_lens or ([48, 96] if a.smoke else [32768, 131072])
    info = device_info()
    peak_bf16, peak_fp32 = peak_flops(info["device"])
    attn = build(cfg, device, dtype)
    timer, rows = Timer(device), []
    for i, t in enumerate(seq_lens):
        iters = a.iters if t <= 32768 else a.long_iters
        for row in measure_t(attn, cfg, t, a.paths, device, dtype, timer, a.warmup if i == 0 else 0, iters):
            rows.append(utilization(row, peak_bf16, peak_fp32))
        print(table([r for r in rows if r["seq_len"] == t], info["device"]).split("\n", 2)[-1], flush=True)
        free_cuda()
    setup = {"config": {k: getattr(cfg, k) for k in ("hidden_size", "num_heads", "q_lora_rank", "kv_lora_rank",
                                                       "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                                       "num_indexer_heads", "indexer_head_dim", "index_topk",
                                                       "dsa_chunk_tokens")},
             "dtype": str(dtype).replace("torch.", ""), "peak_bf16_flops": peak_bf16, "peak_fp32_flops": peak_fp32,
             "device": info, "command": "python3 -m benchmarks.gpu.bench_dsa_layer " + " ".join(argv or [])}
    result = {"rows": rows, "setup": setup}
    print(table(rows, info["device"], setup["dtype"]))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "dsa_layer.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
