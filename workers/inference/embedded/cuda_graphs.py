"""CUDA graphs of the static engine's decode step, one per batch size.

Why: a decode step of a MoE model is a few hundred small kernels; launched one by one from Python
the GPU waits on the host (issue 24 measured 10.5 ms of GPU work per 58 ms of CPU per 3 steps).
A graph replays the whole step -- forward, sampling, logprob, routed-expert record, bookkeeping
-- with one launch.

A graph is frozen to its shapes, so one is captured per size in :func:`graph_batch_sizes` and the
engine pads the running batch up to the nearest one (rows of free slots ride along inactive).
Every input and output lives in the engine's preallocated buffers
(workers/inference/embedded/decode_loop.py), which is what makes replay correct. All graphs share
one memory pool and are captured largest first, so the smaller ones reuse its blocks.

Capture runs the step a few times eagerly first (kernel autotuning, lazy allocations, the MoE
expert stacks) on a side stream. The step must therefore be harmless to run when no slot is
active, which the decode loop guarantees (inactive rows write only to scratch positions).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

log = logging.getLogger("slurmrl.inference")

WARMUP_RUNS = 2


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to 64 and of 32 above, and ``max_batch`` itself:
    padding wastes at most 1/8 of a step above 8 rows (dense enough for continuous batching)."""
    sizes = {n for n in (1, 2, 4) if n < max_batch}
    sizes |= set(range(8, min(max_batch, 64) + 1, 8)) | set(range(96, max_batch + 1, 32)) | {max_batch}
    return sorted(sizes)


class DecodeGraphs:
    """``step(b)`` captured for every size in ``sizes``; :meth:`run` replays one."""

    def __init__(self, step: Callable[[int], None], sizes: list[int], device: torch.device):
        self.sizes = sorted(sizes)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                for b in reversed(self.sizes):
                    step(b)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        for b in reversed(self.sizes):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):  # other threads may use CUDA
                step(b)
            self.graphs[b] = g
        torch.cuda.synchronize(device)
        log.info("captured decode CUDA graphs for batch sizes %s in %.2fs", self.sizes, time.perf_counter() - t0)

    def run(self, b: int) -> None:
        """Replay the graph of batch size ``b`` (one of ``sizes``: the caller pads)."""
        self.graphs[b].replay()
