"""The log-prob head at real vocabularies: fused vs checkpointed chunks vs full logits (time and memory).

    python -m benchmarks.gpu.bench_logprob_head --out DIR            # H200: 8192 tokens, hidden 2048, 152k / 164k vocab
    python -m benchmarks.gpu.bench_logprob_head --smoke --out /tmp/x  # CPU, toy sizes, seconds

What the trainer runs per micro-batch after the last layer: lm_head on the scored positions, the
temperature-scaled log-softmax, log p(target) with its gradient and the entropy. Three ways, each
forward + backward of ``sum(g * log p)`` (g random: the loss's per-token gradient) from bf16 hidden
states and a bf16 head weight:

* ``full``: all [N, V] logits at once, autograd through the float32 log-softmax (``logprob_chunk_tokens=0``);
* ``checkpoint``: chunks of ``--chunk`` positions under activation checkpointing (``trainer.logprob_head=checkpoint``);
* ``fused``: workers/models/blocks/fused_logprobs.py (``trainer.logprob_head=fused``, the default).

And, where installed (issue 36 asks them judged at our shapes; ``--libs``), two libraries' fused
linear cross-entropy with ``reduction="none"`` (log p = -loss; neither returns the entropy, which the
trainer logs and the entropy bonus needs, so they would replace only half of what ours computes):

* ``liger``: liger-kernel's ``liger_fused_linear_cross_entropy`` (per-token gradients recomputed in
  the backward);
* ``cce`` / ``cce_exact``: cut-cross-entropy's ``linear_cross_entropy``, with its default gradient
  filter (``filter_eps="high"``: small softmax entries' gradients are skipped, an approximation) and
  without it (``filter_eps=None``: exact, what an RL loss needs).

Each row also gives ``max_abs_logp_err``: the largest |log p - log p(float32 full logits)| over the tokens.

Reported per way: median milliseconds and peak bytes above the inputs (CUDA ``max_memory_allocated``;
on CPU the peak is not measured). Writes ``logprob_head.json`` under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from workers.models.blocks.logprobs import Scoring, chunked_logprobs
from workers.trainer.parallel.tensor import vocab_parallel_target_logprobs

VOCABS = (151936, 163840)
"""Qwen3's and Kimi-K2's vocabularies (DeepSeek-V3's is 129,280)."""


LIBS = ("liger", "cce", "cce_exact")


def lib_logprobs(way: str, h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """log p(target) through a library's fused linear cross-entropy (``reduction="none"``)."""
    if way == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return -liger_fused_linear_cross_entropy(h, w, y, reduction="none")
    from cut_cross_entropy import linear_cross_entropy

    return -linear_cross_entropy(h, w, y, reduction="none", filter_eps="high" if way == "cce" else None)


def logprobs_of(way: str, h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, chunk: int) -> torch.Tensor:
    if way in LIBS:
        return lib_logprobs(way, h, w, y)

    def scorer(z, t):
        return vocab_parallel_target_logprobs(z, t, 1.0, vocab_start=0, group=None)

    score = Scoring(targets=y, scorer=scorer, chunk_tokens=0 if way == "full" else chunk,
                    fused_temperature=1.0 if way == "fused" else None)
    return chunked_logprobs(h, score, lambda x: x @ w.t(), weight=w)[0]


def one(way: str, h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, g: torch.Tensor, chunk: int) -> None:
    h = h.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    if way in LIBS:
        (lib_logprobs(way, h, w, y).float() * g).sum().backward()
        return

    def scorer(z, t):
        return vocab_parallel_target_logprobs(z, t, 1.0, vocab_start=0, group=None)

    score = Scoring(targets=y, scorer=scorer, chunk_tokens=0 if way == "full" else chunk,
                    fused_temperature=1.0 if way == "fused" else None)
    logp, _ = chunked_logprobs(h, score, lambda x: x @ w.t(), weight=w)
    (logp * g).sum().backward()


def measure(way: str, n: int, hidden: int, vocab: int, chunk: int, device: torch.device, iters: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    h = torch.randn(n, hidden, device=device, generator=gen).to(dtype)
    w = (torch.randn(vocab, hidden, device=device, generator=gen) * hidden ** -0.5).to(dtype)
    y = torch.randint(0, vocab, (n,), device=device, generator=gen)
    g = torch.randn(n, device=device, generator=gen)
    cuda = device.type == "cuda"
    with torch.no_grad():
        ref = torch.log_softmax((h.float() @ w.float().t()), -1).gather(1, y[:, None])[:, 0]
        err = float((logprobs_of(way, h, w, y, chunk).float() - ref).abs().max())
        del ref
    one(way, h, w, y, g, chunk)  # warm-up
    times = []
    peak = None
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        one(way, h, w, y, g, chunk)
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        times.append(time.perf_counter() - t0)
    return {"way": way, "tokens": n, "hidden": hidden, "vocab": vocab, "chunk": chunk,
            "ms": 1e3 * sorted(times)[len(times) // 2], "peak_bytes": peak, "max_abs_logp_err": err}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU toy sizes")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=4096, help="trainer.logprob_chunk_tokens")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu/local"))
    ap.add_argument("--libs", action="store_true", help="also liger-kernel and cut-cross-entropy, where importable")
    a = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    n, hidden, vocabs, chunk = ((64, 32, (1000,), 16) if a.smoke else (a.tokens, a.hidden, VOCABS, a.chunk))
    rows = []
    ways = ("fused", "checkpoint", "full") + (LIBS if a.libs else ())
    for vocab in vocabs:
        for way in ways:
            try:
                r = measure(way, n, hidden, vocab, chunk, device, 1 if a.smoke else a.iters)
            except Exception as e:  # noqa: BLE001 - a library absent or failing here is a result, said so
                rows.append({"way": way, "vocab": vocab, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                print(f"vocab {vocab:>7}  {way:10s} failed: {rows[-1]['error']}", flush=True)
                continue
            rows.append(r)
            mib = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.0f}"
            print(f"vocab {vocab:>7}  {way:10s} {r['ms']:9.2f} ms  peak {mib:>7} MiB  "
                  f"max |logp err| {r['max_abs_logp_err']:.2e}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    by = {(r["vocab"], r["way"]): r for r in rows if "ms" in r}
    speedup = {str(v): by[(v, "checkpoint")]["ms"] / by[(v, "fused")]["ms"] for v in vocabs}
    versus = {f"{v}_{lib}_ms_over_fused": by[(v, lib)]["ms"] / by[(v, "fused")]["ms"]
              for v in vocabs for lib in LIBS if (v, lib) in by}
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "rows": rows,
              "fused_speedup_over_checkpoint": speedup, "libraries_ms_over_fused": versus}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "logprob_head.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out / 'logprob_head.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
