"""Where the real-shape training step's time goes, ours compiled against transformers compiled
(issue 36's ``ratio_ours_compiled_over_hf_compiled``): per-phase times and the top CUDA kernels.

    PYTHONPATH=$PWD python3 -m benchmarks.gpu.profile_model_parity [--families qwen3_moe,deepseek_v3] [--out DIR]
    python3 -m benchmarks.gpu.profile_model_parity --toy --device cpu --backend aot_eager   # CPU smoke

The models are benchmarks.model_parity's ``--size real`` pair (128 experts top-8, 152k / 164k
vocabularies, 2 x 4k tokens, bf16), ours through ``--ours-head`` (the trainer's default,
``fused_loss``), transformers through logits + float32 cross-entropy. Each step is cut into
forward + loss, backward and the optimizer step with a device sync between them (medians of
``--iters`` steps), so the phase that differs shows; then one profiled step per model gives the
kernels that take the CUDA time. A head-only row times the loss head on the same hidden states:
our fused log-prob heads (workers/models/blocks/fused_logprobs.py, fused_loss_head.py) against logits + float32 cross-entropy (transformers').
Writes ``profile_model_parity.json`` and prints the tables.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from benchmarks import model_parity as mp
from benchmarks import model_shapes


def phases(model, ids, opt, head: Optional[str], iters: int, sync) -> dict[str, float]:
    """Median seconds of forward + loss, backward and optimizer (step + zero_grad), synced apart.
    ``head``: ours through that log-prob head (model_parity.HEADS); None: transformers' logits + CE."""
    rows = []
    for i in range(iters + 2):
        sync()
        t0 = time.perf_counter()
        loss = mp.loss_of(model, ids, ours=head is not None, head=head or "logits")
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t3 = time.perf_counter()
        if i >= 2:
            rows.append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
    med = lambda j: sorted(r[j] for r in rows)[len(rows) // 2]  # noqa: E731
    return {"forward_s": med(0), "backward_s": med(1), "optimizer_s": med(2), "step_s": med(3)}


def kernels(model, ids, opt, head: Optional[str], top: int) -> list[dict]:
    """One profiled step: the ``top`` kernels by total CUDA time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ids.is_cuda else [])
    with profile(activities=acts) as prof:
        mp.loss_of(model, ids, ours=head is not None, head=head or "logits").backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ids.is_cuda:
            torch.cuda.synchronize()
    attr = "device_time_total" if ids.is_cuda else "cpu_time_total"
    evs = [e for e in prof.key_averages() if (not ids.is_cuda) or getattr(e, "self_device_time_total", 0) > 0]
    key = (lambda e: e.self_device_time_total) if ids.is_cuda else (lambda e: e.self_cpu_time_total)
    evs.sort(key=key, reverse=True)
    return [{"name": e.key[:90], "calls": e.count, "self_ms": key(e) / 1e3, "total_ms": getattr(e, attr) / 1e3}
            for e in evs[:top]]


def head_only(hidden: int, vocab: int, tokens: int, device: str, dtype, iters: int, sync) -> dict[str, float]:
    """Forward + backward of the loss head alone on the same [tokens, hidden]: ours fused vs logits + CE."""
    from workers.models.blocks.fused_logprobs import fused_target_logprobs

    g = torch.Generator(device="cpu").manual_seed(0)
    h = (torch.randn(tokens, hidden, generator=g) * 0.5).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * hidden ** -0.5).to(device, dtype).requires_grad_()
    tgt = torch.randint(0, vocab, (tokens,), generator=g).to(device)

    def ours():
        lp, _ent = fused_target_logprobs(h, w, tgt, 1.0, mp.HEAD_CHUNK)
        (-lp.mean()).backward()

    def ours_one_pass():  # trainer.logprob_head=fused_loss: the loss's gradient in the head's forward
        from workers.models.blocks.fused_loss_head import fused_loss_logprobs

        loss, _lp, _ent = fused_loss_logprobs(h, w, tgt, 1.0, mp.HEAD_CHUNK, lambda lp, a, b: -lp.sum() / tokens)
        loss.backward()

    def theirs():
        logits = torch.nn.functional.linear(h, w)
        torch.nn.functional.cross_entropy(logits.float(), tgt).backward()

    out = {}
    for name, fn in (("ours_fused", ours), ("ours_fused_loss", ours_one_pass), ("logits_ce", theirs)):
        ts = []
        for i in range(iters + 2):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if i >= 2:
                ts.append(time.perf_counter() - t0)
            h.grad = w.grad = None
        out[f"{name}_s"] = sorted(ts)[len(ts) // 2]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="qwen3_moe,deepseek_v3")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--fused-adamw", action="store_true",
                    help="AdamW(fused=True) for both (the default of our trainer on CUDA and of transformers' Trainer)")
    ap.add_argument("--ours-head", choices=mp.HEADS, default="fused_loss",
                    help="our model's log-prob head (the trainer's default: fused_loss)")
    ap.add_argument("--toy", action="store_true", help="model_parity's --toy widths (CPU smoke)")
    ap.add_argument("--out", default="benchmarks/out")
    a = ap.parse_args(argv)
    if a.toy:
        model_shapes.shrink_real_configs()
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    result = {"device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "batch": a.batch, "seq_len": a.seq, "rows": []}
    for family in a.families.split(","):
        model_type, kw = model_shapes.real_configs()[family]
        shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
        with tempfile.TemporaryDirectory(dir=shm) as tmp:
            hf, ours, _cfg = mp.build_pair(family, model_type, kw, Path(tmp), dtype, a.device)
        ids = torch.randint(0, kw["vocab_size"], (a.batch, a.seq), generator=torch.Generator().manual_seed(1)).to(a.device)
        models = {"ours_compiled": mp.compiled_copy(ours, a.backend).to(dtype).train()}
        hf_c, err = mp.hf_compiled_copy(hf, a.backend, ids, dtype)
        if hf_c is None:
            print(f"{family}: transformers compiled failed: {err}")
            continue
        models["hf_compiled"] = hf_c.to(dtype).train()
        del hf, ours
        row = {"family": family, "vocab_size": kw["vocab_size"], "tokens": a.batch * a.seq, "ours_head": a.ours_head}
        from torch._dynamo.utils import counters

        counters["graph_break"].clear()
        for name, m in models.items():
            opt = torch.optim.AdamW(m.parameters(), lr=1e-6, fused=a.fused_adamw or None)
            head = a.ours_head if name.startswith("ours") else None
            row[name] = phases(m, ids, opt, head, a.iters, sync)
            row[name]["kernels"] = kernels(m, ids, opt, head, a.top)
            print(f"== {family} {name}: " + "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in row[name].items()
                                                      if k.endswith("_s")), flush=True)
            for k in row[name]["kernels"]:
                print(f"   {k['self_ms']:8.2f} ms {k['calls']:5d}x  {k['name']}")
            del opt
        row["graph_breaks"] = {k: v for k, v in counters["graph_break"].items()}
        print(f"== {family} graph breaks (both models): {row['graph_breaks']}")
        row["head_only"] = head_only(kw["hidden_size"], kw["vocab_size"], a.batch * a.seq, a.device, dtype, a.iters,
                                     sync)
        print(f"== {family} head only: " + "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in row["head_only"].items()))
        result["rows"].append(row)
        del models
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "profile_model_parity.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
