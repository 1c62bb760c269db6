"""Peak trainer memory of one packed long row on CPU: is it linear in the sequence length?

    python -m benchmarks.long_context [--seq-lens 8192 16384 32768 65536] [--cp 1] [--ac full]

Why: the mission's episodes reach 131,072 tokens. What used to grow as T^2 in one trainer step
(the packed row's [T, T] block mask, SDPA's masked scores) or as T x V (full-vocabulary logits)
is now per document (workers/models/blocks/varlen.py) and per chunk of ``trainer.logprob_chunk_tokens``
(workers/models/blocks/logprobs.py). Target: peak(64k) / peak(8k) <= 9 (linear, some slack).

Each (seq_len, cp) point is a fresh set of ``cp`` spawned gloo processes (so nothing of an earlier
point stays resident): the tiny MoE (benchmarks/gpu/common.py TINY_MOE, float32), the trainer's
FSDP plan, ``trainer.pack_sequences=true``, Router Replay on, activation checkpointing ``--ac``, one
row of ``seq_len`` valid tokens (loss on the last 7/8). A warm-up step on a 512-token row first
puts the runtime's one-time memory and the AdamW state in the baseline; then the measured step.
``peak_bytes_per_rank``: the process's resident high-water mark during that step (Linux VmHWM,
reset with /proc/self/clear_refs) minus its resident memory just before it, max over ranks. RSS
is what torch's CPU allocator really takes (tracemalloc does not see it); large blocks are mmap'd
(MALLOC_MMAP_THRESHOLD_) so freed activations leave the RSS.

Context parallelism: ``python -m benchmarks.long_context_cp`` (cp > 1 splits the row over ranks and
attends with a whole-sequence mask, not per document; ``--cp`` here takes 1 only). Writes benchmarks/out/long_context.json
``{"runs": [{"seq_len": T, "cp": C, "peak_bytes_per_rank": P}], "setup": {...}}``.
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
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.gpu.bench_trainer_step import synthetic_batch
from benchmarks.gpu.common import TINY_MOE
from benchmarks.trainer_memory import _rss, _trim
from benchmarks.local_ranks import free_port, gloo_dims, rank_entry
from workers.common.config import TrainerConfig
from workers.models.tiny_moe.model import build_model
from workers.trainer.parallel.fsdp import parallelize
from workers.trainer.micro import apply_activation_checkpointing
from workers.trainer.precision import Precision
from workers.trainer.step import train_step
from benchmarks.record import results_dir, scratch_dir

RESULTS = results_dir()
WARM_UP_TOKENS = 512


def trainer_config(args: argparse.Namespace) -> TrainerConfig:
    """The step measured (``args``: ac, chunk; optional ``dtype``, ``model`` a TinyMoeConfig, as tests set)."""
    return TrainerConfig(lr=1e-4, router_replay=True, pack_sequences=True, activation_checkpointing=args.ac,
                         logprob_chunk_tokens=args.chunk, ratio_mask_low=1e-9, ratio_mask_high=1e9,
                         dtype=getattr(args, "dtype", "float32"))


def _worker(rank: int, world: int, port: int, seq_len: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dims = gloo_dims(rank, world, port)
    try:
        tcfg = trainer_config(args)
        base = getattr(args, "model", None) or TINY_MOE
        cfg = dataclasses.replace(base, max_position_embeddings=max(seq_len, base.max_position_embeddings))
        full = build_model(cfg, 0)
        apply_activation_checkpointing(full.model.layers, tcfg.activation_checkpointing)
        model = parallelize(full, dims, precision=Precision.of(tcfg))
        opt = torch.optim.AdamW(model.parameters(), lr=tcfg.lr)
        train_step(model, opt, synthetic_batch(cfg, 1, WARM_UP_TOKENS, seed=1), tcfg, dims)
        batch = synthetic_batch(cfg, 1, seq_len, seed=0)
        _trim()
        base = _rss("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: the measured step's peak only
        t0 = time.perf_counter()
        train_step(model, opt, batch, tcfg, dims)
        step_s = time.perf_counter() - t0
        got = torch.tensor([_rss("VmHWM") - base, step_s], dtype=torch.float64)
        dist.all_reduce(got, op=dist.ReduceOp.MAX)
        if rank == 0:
            Path(out).write_text(json.dumps({"seq_len": seq_len, "cp": world, "peak_bytes_per_rank": int(got[0]),
                                             "step_s": float(got[1])}))
    finally:
        dist.destroy_process_group()


def measure(seq_len: int, cp: int, args: argparse.Namespace, tmp: Path, timeout_s: float = 1800.0) -> dict:
    """One point in fresh processes; ``cp`` ranks once the trainer splits a sequence over them."""
    if cp != 1:  # the cp path attends with a whole-sequence mask, not per document: not this benchmark's row
        raise SystemExit(f"--cp {cp}: context parallelism has its own benchmark, python -m benchmarks.long_context_cp")
    out = tmp / f"T{seq_len}_cp{cp}.json"
    for attempt in range(2):  # a second try only for a port another process took between pick and bind
        ctx = mp.start_processes(rank_entry, args=(_worker, cp, free_port(), seq_len, args, str(out)), nprocs=cp,
                                 join=False, start_method="spawn")  # rank_entry: no abort at exit
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    raise TimeoutError(f"seq_len {seq_len} cp {cp} did not finish in {timeout_s}s")
            return json.loads(out.read_text())
        except mp.ProcessExitedException:
            if attempt:
                raise
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    ap.add_argument("--cp", type=int, nargs="+", default=[1])
    ap.add_argument("--ac", default="full", choices=["none", "full", "selective"])
    ap.add_argument("--chunk", type=int, default=TrainerConfig().logprob_chunk_tokens)
    ap.add_argument("--out", type=Path, default=RESULTS / "long_context.json")
    args = ap.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # read by the spawned ranks at start
    tmp = scratch_dir(".long_context.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    runs = []
    print(f"{'seq_len':>8} {'cp':>3} {'peak MiB/rank':>14} {'x first':>8} {'step s':>8}", flush=True)
    for cp in args.cp:
        for t in args.seq_lens:
            r = measure(t, cp, args, tmp)
            runs.append(r)
            print(f"{t:>8} {cp:>3} {r['peak_bytes_per_rank'] / 2**20:>14.1f} "
                  f"{r['peak_bytes_per_rank'] / runs[0]['peak_bytes_per_rank']:>8.2f} {r['step_s']:>8.1f}", flush=True)
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    one = {r["seq_len"]: r["peak_bytes_per_rank"] for r in runs if r["cp"] == 1}
    lo, hi = min(one, default=0), max(one, default=0)
    setup = {"model": dataclasses.asdict(TINY_MOE), "dtype": "float32", "plan": "workers.trainer.parallel.fsdp:parallelize",
             "pack_sequences": True, "router_replay": True, "activation_checkpointing": args.ac,
             "logprob_chunk_tokens": args.chunk, "rows": 1, "threads_per_rank": 1,
             "target": "peak(64k) / peak(8k) <= 9 (linear)",
             "ratio_longest_to_shortest": one[hi] / one[lo] if one else None, "length_ratio": hi / lo if one else None}
    result = {"runs": [{k: r[k] for k in ("seq_len", "cp", "peak_bytes_per_rank")} for r in runs],
              "step_s": {f"{r['seq_len']}/cp{r['cp']}": r["step_s"] for r in runs}, "setup": setup}
    if one:
        print(f"peak({hi}) / peak({lo}) = {setup['ratio_longest_to_shortest']:.2f} for {hi / lo:.0f}x the tokens")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
