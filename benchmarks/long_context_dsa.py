"""Peak memory of GLM-5's DSA layers on one long packed row: dense reference vs the memory-linear path.

    python -m benchmarks.long_context_dsa [--seq-lens 8192 16384 32768] [--chunk 256] [--dense-max 8192]
    python -m benchmarks.long_context_dsa --device cuda --seq-lens 8192 16384 32768 65536 131072 --dense-max 32768

Why: the DSA indexer's dense reference path (``model.dsa_chunk_tokens=0``) scores every (query,
key) pair and masks dense attention, [T, T] per layer: ~2.3 TB at 131k for GLM-5. The chunked path
(workers/models/blocks/dsa_sparse.py) keeps only each query's top-k positions and one chunk of
scores and gathered latents: linear in T. This measures both on a tiny GLM-5 (:data:`TINY_GLM`:
3 MLA + DSA layers, hidden 64, index_topk 256, so the choice matters at every length).

Each point (seq_len, path) runs in a fresh spawned process: the model (float32 on CPU, bf16 on
CUDA), activation checkpointing ``--ac`` (full: the trainer's default at long context), one packed
row of one ``seq_len`` document (``segment_ids``: the trainer's packed path, no [T, T] mask
outside DSA), forward + backward of a scalar over every logit, after a 512-token warm-up.
``peak_bytes``: CPU, the resident high-water mark during the step (VmHWM reset through
/proc/self/clear_refs) minus the resident memory before it, large blocks mmap'd so freed
activations leave the RSS (as benchmarks/long_context.py); CUDA, ``max_memory_allocated`` minus
the allocated memory before the step. The dense path is skipped above ``--dense-max`` (its
quadratic scores do not fit this machine); the table then says so.

Writes benchmarks/out/long_context_dsa.json (CUDA: benchmarks/out/gpu/long_context_dsa.json)
``{"runs": [{"seq_len": T, "path": "dense" | "chunked", "peak_bytes": P, "step_s": s}], "setup": {...}}``.
``--record`` writes into the tracked benchmarks/results/ instead (benchmarks/record.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from benchmarks.trainer_memory import _rss, _trim
from workers.common.registry import MODELS
from workers.models.glm_moe_dsa.config import GlmMoeDsaConfig
from workers.trainer.micro import apply_activation_checkpointing
from benchmarks.record import results_dir, scratch_dir

RESULTS = results_dir()
WARM_UP_TOKENS = 512
TINY_GLM = GlmMoeDsaConfig(
    name="bench_glm_moe_dsa_tiny", vocab_size=256, hidden_size=64, num_layers=3, num_heads=4, num_experts=8, top_k=2,
    expert_intermediate_size=32, num_shared_experts=1, num_dense_layers=1, dense_intermediate_size=128,
    num_expert_groups=4, topk_groups=2, routed_scaling_factor=2.5, q_lora_rank=32, kv_lora_rank=16,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_indexer_heads=4, indexer_head_dim=16,
    index_topk=256, max_position_embeddings=131072, init_seed=1234)
"""GLM-5's layer kinds at CPU size (hydra_conf/model/glm_moe_dsa_tiny.yaml, with a 256-key top-k)."""


def _step(model, t: int, vocab: int, device) -> None:
    ids = torch.randint(1, vocab, (1, t), generator=torch.Generator().manual_seed(t)).to(device)
    out = model(ids, position_ids=torch.arange(t, device=device)[None],
                attention_mask=torch.ones(1, t, dtype=torch.bool, device=device),
                segment_ids=torch.zeros(1, t, dtype=torch.long, device=device))
    out.logits.float().logsumexp(-1).sum().backward()
    model.zero_grad(set_to_none=True)


def _worker(seq_len: int, chunk: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    device = torch.device(args.device)
    cfg = dataclasses.replace(TINY_GLM, dsa_chunk_tokens=chunk)
    model = MODELS.get(cfg.family).init(cfg, torch.bfloat16 if cuda else torch.float32).to(device)
    apply_activation_checkpointing(model.model.layers, args.ac)
    _step(model, WARM_UP_TOKENS, cfg.vocab_size, device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        _trim()
        base = _rss("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: the measured step's peak only
    t0 = time.perf_counter()
    _step(model, seq_len, cfg.vocab_size, device)
    if cuda:
        torch.cuda.synchronize()
    step_s = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() if cuda else _rss("VmHWM")) - base
    Path(out).write_text(json.dumps({"seq_len": seq_len, "path": "chunked" if chunk else "dense",
                                     "peak_bytes": int(peak), "step_s": step_s}))


def measure(seq_len: int, chunk: int, args: argparse.Namespace, tmp: Path, timeout_s: float = 1800.0) -> dict:
    """One point in a fresh process (nothing of an earlier point stays resident)."""
    out = tmp / f"T{seq_len}_c{chunk}.json"
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_worker, args=(seq_len, chunk, args, str(out)))
    p.start()
    p.join(timeout_s)
    if p.is_alive():
        p.kill()
        raise TimeoutError(f"seq_len {seq_len} chunk {chunk} did not finish in {timeout_s}s")
    if p.exitcode != 0:
        raise RuntimeError(f"seq_len {seq_len} chunk {chunk}: worker exited with {p.exitcode}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--chunk", type=int, default=GlmMoeDsaConfig.dsa_chunk_tokens, help="model.dsa_chunk_tokens")
    ap.add_argument("--dense-max", type=int, default=8192, help="longest row the dense reference path runs")
    ap.add_argument("--ac", default="full", choices=["none", "full"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.chunk <= 0:
        raise SystemExit("--chunk must be > 0 (the dense reference path runs beside it anyway)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    out_path = args.out or (RESULTS / "gpu" / "long_context_dsa.json" if args.device == "cuda"
                            else RESULTS / "long_context_dsa.json")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # read by the spawned workers at start
    tmp = scratch_dir(".long_context_dsa.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    runs = []
    print(f"{'seq_len':>8} {'dense MiB':>10} {'chunked MiB':>12} {'dense/chunked':>14} {'dense s':>8} {'chunked s':>10}",
          flush=True)
    for t in args.seq_lens:
        row = {"chunked": measure(t, args.chunk, args, tmp)}
        if t <= args.dense_max:
            row["dense"] = measure(t, 0, args, tmp)
        runs += [row[k] for k in ("dense", "chunked") if k in row]
        c, d = row["chunked"], row.get("dense")
        mib = lambda r: f"{r['peak_bytes'] / 2**20:.1f}" if r else "skipped"  # noqa: E731
        print(f"{t:>8} {mib(d):>10} {mib(c):>12} "
              f"{(d['peak_bytes'] / c['peak_bytes'] if d else float('nan')):>14.2f} "
              f"{(d['step_s'] if d else float('nan')):>8.1f} {c['step_s']:>10.1f}", flush=True)
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    chunked = {r["seq_len"]: r["peak_bytes"] for r in runs if r["path"] == "chunked"}
    lo, hi = min(chunked), max(chunked)
    setup = {"model": dataclasses.asdict(TINY_GLM), "dsa_chunk_tokens": args.chunk, "device": args.device,
             "dtype": "bfloat16" if args.device == "cuda" else "float32", "activation_checkpointing": args.ac,
             "rows": 1, "documents_per_row": 1, "dense_max": args.dense_max,
             "chunked_ratio_longest_to_shortest": chunked[hi] / chunked[lo], "length_ratio": hi / lo}
    print(f"chunked: peak({hi}) / peak({lo}) = {setup['chunked_ratio_longest_to_shortest']:.2f} for {hi / lo:.0f}x "
          f"the tokens")
    result = {"runs": runs, "setup": setup}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
