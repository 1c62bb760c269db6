"""Several ranks on one machine: a free port, and real processes joined in a gloo group.

Why here and not under tests/ or workers/: the CPU benchmarks (benchmarks/long_context_cp.py,
benchmarks/trainer_memory.py) and the multi-rank tests start ranks the same way; benchmarks must
not import tests/, and workers/common (shared by every role) must not import the trainer. One way to start them means one deadline rule: a rank that
hangs (a collective some rank never joins) is killed after ``timeout_s`` with a message that
names the run, instead of hanging the caller.

    run_ranks(worker, world, (cfg, out), what="cp2 step")   # worker(rank, world, port, cfg, out)

Each worker joins its group itself (``gloo_dims`` for the trainer's ParallelDims) and writes
its result to a file the caller reads back: processes share nothing else. Every rank process
ends through :func:`exit_rank` (:func:`rank_entry`), never through interpreter teardown, which
aborted two-process gloo runs at exit now and then; tools that start ranks themselves use
:func:`rank_entry` too.
"""
from __future__ import annotations

import time
from typing import Callable

from workers.common.ports import free_port  # noqa: F401  (callers take both from here)
from workers.common.rank_exit import exit_rank, rank_entry  # noqa: F401  (re-exported for the tools)


def gloo_dims(rank: int, world: int, port: int, *, tp: int = 1, ep: int = 1, cp: int = 1):
    """Join a real gloo group of ``world`` processes on ``port`` and return the trainer's
    ParallelDims over it (dp = world / (tp * ep * cp)); the caller destroys the process group."""
    import torch
    import torch.distributed as dist

    from workers.trainer.parallel.dims import ParallelDims

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dims = ParallelDims(rank=rank, world_size=world, dp=world // (tp * ep * cp), tp=tp, ep=ep, cp=cp, backend="gloo",
                        device=torch.device("cpu"), group=dist.group.WORLD)
    dims.groups = dims.new_groups()
    return dims


def forked_rank_entry(rank: int, worker: Callable, *args) -> None:
    """:func:`rank_entry` for a forked rank: one intra-op thread first. Why: a parent that ran a parallel
    torch op (OpenMP's thread pool started) leaves its forked children a pool whose threads do not exist
    there, and their first parallel op hung forever (a SmolLM2 test before the mesh-plan tests did it)."""
    import torch

    torch.set_num_threads(1)
    rank_entry(rank, worker, *args)


def run_ranks(worker: Callable, world: int, args: tuple, *, what: str, timeout_s: float = 180.0,
              start_method: str = "fork") -> None:
    """Run ``worker(rank, world, port, *args)`` in ``world`` processes (a free port for their
    gloo group) and wait, with a deadline that names ``what``; a rank's exception fails the call.

    ``start_method``: "fork" is fast and fine for tests; "spawn" gives each rank a fresh
    interpreter (a benchmark measuring per-rank memory must not inherit the parent's heap).
    """
    import torch.multiprocessing as mp

    entry = forked_rank_entry if start_method == "fork" else rank_entry
    ctx = mp.start_processes(entry, args=(worker, world, free_port(), *args), nprocs=world, join=False,
                             start_method=start_method)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"{what} ({world} ranks) did not finish in {timeout_s}s")
