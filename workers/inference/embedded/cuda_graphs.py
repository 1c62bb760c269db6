"""CUDA graphs of the static engine's decode step, one per (batch size, key length, sampling).

Why: a decode step of a MoE model is a few hundred small kernels; launched one by one from Python
the GPU waits on the host (issue 24 measured 10.5 ms of GPU work per 58 ms of CPU per 3 steps).
A graph replays the whole step -- forward, sampling, logprob, routed-expert record, bookkeeping
-- with one launch.

A graph is frozen to its shapes, so the engine pads the running batch up to a size of
:func:`graph_batch_sizes` (rows of free slots ride along inactive) and attends over a key window
of :func:`key_buckets` positions (the smallest that covers every running sequence for the next
block), and one graph is kept per (size, window, greedy-or-sampling) key. Every input and output
lives in the engine's preallocated buffers (workers/inference/embedded/static_engine.py), which is
what makes replay correct. All graphs share one memory pool: their intermediates die inside each
replay and replays never overlap.

Graphs are captured on first use, also while requests are running: capture first runs the step
eagerly (kernel selection, lazy allocations, the MoE expert stacks) with every slot marked
inactive by ``quiesce``, which makes a step harmless -- inactive rows write their history to
scratch and change neither their next token nor their position, and the keys they write at
their next position are the ones the real step writes there before reading them.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, ContextManager

import torch

log = logging.getLogger("slurmrl.inference")

WARMUP_RUNS = 2


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to 64 and of 32 above, and ``max_batch`` itself:
    padding wastes at most 1/8 of a step above 8 rows (dense enough for continuous batching)."""
    sizes = {n for n in (1, 2, 4) if n < max_batch}
    sizes |= set(range(8, min(max_batch, 64) + 1, 8)) | set(range(96, max_batch + 1, 32)) | {max_batch}
    return sorted(sizes)


def key_buckets(max_len: int, smallest: int) -> list[int]:
    """Key windows: ``smallest`` doubled until ``max_len`` (always included). Attention reads at
    most twice the keys it needs, with few graphs per batch size."""
    out, n = {max_len}, smallest
    while n < max_len:
        out.add(n)
        n *= 2
    return sorted(out)


def first_at_least(options: list[int], n: int) -> int:
    return next(o for o in options if o >= n)


class DecodeGraphs:
    """``step(*key)`` captured on first use of each ``key``; :meth:`run` replays it."""

    def __init__(self, step: Callable[..., None], quiesce: Callable[[], ContextManager], device: torch.device):
        self.step, self.quiesce, self.device = step, quiesce, device
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = None  # made at the first capture
        self.capture_s = 0.0

    def run(self, key: tuple) -> None:
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._capture(key)
        g.replay()

    def _capture(self, key: tuple) -> torch.cuda.CUDAGraph:
        t0 = time.perf_counter()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        main = torch.cuda.current_stream(self.device)
        with self.quiesce():
            side = torch.cuda.Stream(self.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    self.step(*key)
            main.wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):  # other threads may use CUDA
                self.step(*key)
        dt = time.perf_counter() - t0
        self.capture_s += dt
        log.info("captured the decode CUDA graph %s in %.3fs (%d graphs, %.1fs in all)", key, dt,
                 len(self.graphs) + 1, self.capture_s)
        return g
