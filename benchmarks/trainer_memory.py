"""Per-rank trainer memory under the FSDP2 plan, and what float32 master weights buy.

    python -m benchmarks.trainer_memory [--worlds 1 2 4] [--hidden 256] [--layers 8] [--steps 2]

Why: the old trainer replicated parameters, gradients and AdamW state on every data-parallel rank
(8-16 B/param on each GPU). workers/trainer/parallel/fsdp.py shards all three over the ranks, so a rank's
share should fall as 1/world (target: world 4 <= 0.30x world 1).

Each world runs as real gloo processes on CPU (spawned, a free port each): the seeded tiny_moe
model, float32 master weights, ``fully_shard`` per layer + root with dp_shard = world, ``steps``
trainer steps (workers/trainer/step.py train_step, Router Replay on). Measured per rank, after
the last step (gradients kept):

- ``state_bytes_per_rank``: local shards of parameters + gradients + AdamW state (exact bytes);
- ``peak_bytes_per_rank``: the process's peak resident memory during the steps (Linux VmHWM,
  reset after sharding with /proc/self/clear_refs) minus its resident memory before the model
  was built (after a warm-up step of a 16-wide copy, so the runtime's one-time memory is in the
  baseline): the training's own footprint (state, gathered layers, activations), max over ranks.

Also: the fraction of a 2048x2048 matrix's weights that three AdamW steps at lr 1e-6 change when
the master weights are float32 vs bfloat16 (workers/trainer/precision.py update_fraction).
Writes benchmarks/results/trainer_memory.json.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.local_ranks import gloo_dims, run_ranks
from workers.common.config import TrainerConfig
from workers.models.tiny_moe.model import TinyMoeConfig, build_model
from workers.trainer.batch import RolloutBatch, shard_rows
from workers.trainer.parallel.fsdp import parallelize, sharded_bytes
from workers.trainer.precision import Precision, update_fraction
from workers.trainer.step import train_step
from benchmarks.record import results_dir, scratch_dir

RESULTS = results_dir()


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _trim() -> None:
    """Hand freed heap back to the OS so RSS reflects live tensors (glibc keeps it otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def make_batch(cfg: TinyMoeConfig, rows: int, length: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    attn = torch.ones(rows, length, dtype=torch.bool)
    loss = torch.arange(length)[None].expand(rows, length) >= length // 2
    ids = torch.randint(0, cfg.vocab_size, (rows, length), generator=g)
    experts = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:cfg.top_k]
                           for _ in range(rows * length * cfg.num_layers)]).view(rows, length, cfg.num_layers, cfg.top_k)
    return RolloutBatch(input_ids=ids, attention_mask=attn, loss_mask=loss,
                        inference_logprobs=torch.full((rows, length), -6.0) * loss, advantages=torch.randn(rows, generator=g),
                        rewards=torch.zeros(rows), token_versions=torch.zeros(rows, length, dtype=torch.int32),
                        routed_experts=experts, routed_mask=attn.clone(), meta={"temperature": 1.0, "step": 0})


def _worker(rank: int, world: int, port: int, cfg: TinyMoeConfig, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dims = gloo_dims(rank, world, port)
    try:
        tcfg = TrainerConfig(lr=1e-4, router_replay=True)
        warm_up(cfg, args, tcfg, dims)
        _trim()
        base = _rss("VmRSS")
        model = parallelize(build_model(cfg, 0), dims, precision=Precision.of(tcfg))
        opt = torch.optim.AdamW(model.parameters(), lr=tcfg.lr)
        batch = shard_rows(make_batch(cfg, args.rows, args.length), dims.batch_rank, dims.num_batch_shards)
        _trim()
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: peak of the steps only
        for _ in range(args.steps):
            train_step(model, opt, batch, tcfg, dims)
        peak = _rss("VmHWM") - base
        state = sharded_bytes(model, opt)
        got = torch.tensor([state, peak], dtype=torch.float64)
        dist.all_reduce(got, op=dist.ReduceOp.MAX)
        if rank == 0:
            Path(out).write_text(json.dumps({"world": world, "state_bytes_per_rank": int(got[0]),
                                             "peak_bytes_per_rank": int(got[1]),
                                             "num_params": sum(p.numel() for p in build_model(cfg, 0).parameters())}))
    finally:
        dist.destroy_process_group()


def warm_up(cfg: TinyMoeConfig, args: argparse.Namespace, tcfg: TrainerConfig, dims) -> None:
    """One step of a 16-wide copy of the model first: the runtime's one-time memory (autograd and
    gloo threads, their malloc arenas, kernels' caches) is then in the baseline, not in the peak."""
    small = dataclasses.replace(cfg, hidden_size=16, expert_intermediate_size=16, num_heads=2)
    model = parallelize(build_model(small, 0), dims)
    opt = torch.optim.AdamW(model.parameters(), lr=tcfg.lr)
    batch = shard_rows(make_batch(small, args.rows, args.length), dims.batch_rank, dims.num_batch_shards)
    train_step(model, opt, batch, tcfg, dims)
    del model, opt


def run_world(world: int, cfg: TinyMoeConfig, args: argparse.Namespace, tmp: Path, timeout_s: float = 600.0) -> dict:
    out = tmp / f"world{world}.json"
    run_ranks(_worker, world, (cfg, args, str(out)), what=f"world {world}", timeout_s=timeout_s, start_method="spawn")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--matrix", type=int, default=2048)
    args = ap.parse_args(argv)
    cfg = TinyMoeConfig(vocab_size=1024, hidden_size=args.hidden, num_layers=args.layers, num_heads=4,
                        num_experts=args.experts, top_k=2, expert_intermediate_size=2 * args.hidden,
                        max_position_embeddings=args.length)
    # A fixed mmap threshold: large tensors are mmap'd and unmapped on free, so the resident peak is
    # what the tensors need, not what glibc's heap kept after per-layer buffers came and went.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # read by the spawned ranks at start
    tmp = scratch_dir(".trainer_memory.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    runs = [run_world(w, cfg, args, tmp) for w in args.worlds]
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    one = runs[0]
    fractions = {name: update_fraction(dtype, size=args.matrix, steps=3, lr=1e-6)
                 for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    print(f"tiny_moe hidden {args.hidden}, {args.layers} layers, {args.experts} experts: {one['num_params'] / 1e6:.2f}M "
          f"params, float32 master + AdamW, {args.steps} steps of {args.rows}x{args.length} tokens (Router Replay)")
    print(f"{'world':>5} {'state MB/rank':>14} {'x world 1':>10} {'peak MB/rank':>13} {'x world 1':>10}")
    for r in runs:
        print(f"{r['world']:>5} {r['state_bytes_per_rank'] / 2**20:>14.2f} "
              f"{r['state_bytes_per_rank'] / one['state_bytes_per_rank']:>10.3f} {r['peak_bytes_per_rank'] / 2**20:>13.2f} "
              f"{r['peak_bytes_per_rank'] / one['peak_bytes_per_rank']:>10.3f}")
    print(f"AdamW lr=1e-6, 3 steps, {args.matrix}x{args.matrix}: weights changed float32 master "
          f"{fractions['float32']:.2%}, bfloat16 master {fractions['bfloat16']:.2%}")
    result = {"runs": [{k: r[k] for k in ("world", "state_bytes_per_rank", "peak_bytes_per_rank")} for r in runs],
              "master_update_fraction": fractions,
              "setup": {"model": "tiny_moe", "num_params": one["num_params"], "hidden": args.hidden,
                        "layers": args.layers, "experts": args.experts, "rows": args.rows, "length": args.length,
                        "steps": args.steps, "matrix": args.matrix, "plan": "workers.trainer.parallel.fsdp:parallelize",
                        "state_ratio_world_max": runs[-1]["state_bytes_per_rank"] / one["state_bytes_per_rank"],
                        "peak_ratio_world_max": runs[-1]["peak_bytes_per_rank"] / one["peak_bytes_per_rank"]}}
    (RESULTS / "trainer_memory.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
