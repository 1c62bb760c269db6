"""Peak trainer memory per rank for one long sequence at cp=1 vs cp=2 (context parallelism).

    python -m benchmarks.long_context_cp [--seq-lens 4096 8192 16384] [--cps 1 2]

Why: one 131k-token agentic episode does not fit one GPU's activations; ``trainer.parallel.cp``
(workers/trainer/parallel/context.py) splits the sequence over cp ranks, so a rank should hold
about 1/cp of the activations (target: cp2 / cp1 <= 0.6x at the same length).

Each point is a fresh set of processes (``spawn``; cp ranks are real gloo processes on CPU): the
seeded tiny_moe model in float32 under the FSDP plan on a dp 1 x cp mesh, one row of ``seq_len``
tokens (loss on its second half, Router Replay on), one trainer ``backward_step`` (forward,
loss, backward, gradient reduce-scatter; workers/trainer/step.py). Attention takes the causal
fast path (``kernels.FAST_PATH_ON_CPU``: plain causal SDPA, as on the GPU, no [T, T] mask) so
what is measured is the activations the sequence split divides, not the CPU masked path's dense mask.

Peak, honestly: torch's CPU allocations are invisible to tracemalloc, so this reads the kernel's
account of the process: Linux ``VmHWM`` (peak resident set) reset with /proc/self/clear_refs just
before the step, minus ``VmRSS`` at that moment (model, FSDP state, gloo and autograd runtime
already resident after a warm-up step at 256 tokens), max over the cp ranks. Large tensors are
mmap'd (``MALLOC_MMAP_THRESHOLD_``), so freed activations leave the resident set. The all-to-all
send/receive buffers are the rank's own memory and are counted.
Writes benchmarks/out/long_context_cp.json: ``{"runs": [{"seq_len", "cp", "peak_bytes_per_rank"}]}``.
``--record`` writes into the tracked benchmarks/results/ instead (benchmarks/record.py).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.trainer_memory import _rss, _trim, make_batch
from benchmarks.local_ranks import gloo_dims, run_ranks
from workers.common.config import TrainerConfig
from workers.models.blocks import kernels
from workers.models.tiny_moe.model import TinyMoeConfig, build_model
from workers.trainer.parallel.fsdp import parallelize
from workers.trainer.step import backward_step
from benchmarks.record import results_dir, scratch_dir

RESULTS = results_dir()
WARM_UP_LEN = 256


def _worker(rank: int, world: int, port: int, cfg: TinyMoeConfig, seq_len: int, out: str) -> None:
    torch.set_num_threads(1)
    kernels.FAST_PATH_ON_CPU = True
    dims = gloo_dims(rank, world, port, cp=world)
    try:
        tcfg = TrainerConfig(router_replay=True)
        model = parallelize(build_model(cfg, 0), dims)
        backward_step(model, make_batch(cfg, 1, WARM_UP_LEN), tcfg, dims)  # one-time runtime memory
        batch = make_batch(cfg, 1, seq_len)
        _trim()
        base = _rss("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: the step's peak only
        t0 = time.perf_counter()
        stats = backward_step(model, batch, tcfg, dims)
        seconds = time.perf_counter() - t0
        got = torch.tensor([_rss("VmHWM") - base, seconds], dtype=torch.float64)
        dist.all_reduce(got, op=dist.ReduceOp.MAX)
        if rank == 0:
            Path(out).write_text(json.dumps({"seq_len": seq_len, "cp": world, "peak_bytes_per_rank": int(got[0]),
                                             "step_s": float(got[1]), "loss": stats["loss"]}))
    finally:
        dist.destroy_process_group()


def run_point(cfg: TinyMoeConfig, seq_len: int, cp: int, tmp: Path, timeout_s: float = 900.0) -> dict:
    out = tmp / f"T{seq_len}_cp{cp}.json"
    run_ranks(_worker, cp, (cfg, seq_len, str(out)), what=f"seq_len {seq_len} cp {cp}", timeout_s=timeout_s,
              start_method="spawn")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args(argv)
    cfg = TinyMoeConfig(vocab_size=256, hidden_size=args.hidden, num_layers=args.layers, num_heads=4, num_experts=8,
                        top_k=2, expert_intermediate_size=2 * args.hidden, max_position_embeddings=max(args.seq_lens))
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # read by the spawned ranks at start
    tmp = scratch_dir(".long_context_cp.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    runs = [run_point(cfg, t, cp, tmp) for t in args.seq_lens for cp in args.cps]
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    print(f"tiny_moe hidden {args.hidden}, {args.layers} layers, 8 experts top-2, float32, FSDP, one row, Router Replay")
    print(f"{'seq_len':>8} {'cp':>3} {'peak MB/rank':>13} {'x cp=1':>7} {'step s':>7}")
    ratios = {}
    for r in runs:
        one = next(x for x in runs if x["seq_len"] == r["seq_len"] and x["cp"] == 1)
        ratio = r["peak_bytes_per_rank"] / one["peak_bytes_per_rank"]
        ratios[f"{r['seq_len']}_cp{r['cp']}"] = ratio
        print(f"{r['seq_len']:>8} {r['cp']:>3} {r['peak_bytes_per_rank'] / 2**20:>13.1f} {ratio:>7.3f} {r['step_s']:>7.2f}")
    result = {"runs": [{k: r[k] for k in ("seq_len", "cp", "peak_bytes_per_rank")} for r in runs],
              "setup": {"model": "tiny_moe", "hidden": args.hidden, "layers": args.layers, "experts": 8, "top_k": 2,
                        "dtype": "float32", "plan": "workers.trainer.parallel.fsdp:parallelize", "rows": 1,
                        "attention": "causal fast path (no [T, T] mask)", "peak": "VmHWM - VmRSS before the step",
                        "ratio_to_cp1": ratios, "step_s": {f"{r['seq_len']}_cp{r['cp']}": r["step_s"] for r in runs}}}
    (RESULTS / "long_context_cp.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
