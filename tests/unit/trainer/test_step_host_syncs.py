"""Host syncs of the trainer step do not grow with the number of micro-batches.

A GPU step stalls its launch queue at every device->host copy (``.item()``, ``.tolist()``,
``float(t)``, ``int(t)``, ``bool(t)``): the H200 profile of 2026-12-03 counted ~50 a step. The
per-micro-batch statistics (loss terms, token stats, routing disagreement) now stay on the
device and are read once per step (workers/trainer/step.py ``_Accumulator`` / ``reduce_stats``).
CPU tensors cannot show a sync, so this counts the conversion calls instead: one
``train_step`` with 2, 3 and 6 micro-batches must make the same number of them.
"""
from __future__ import annotations

import contextlib

import torch

from tests.integration import test_parity_parallel as moe
from workers.trainer.parallel.fsdp import parallelize
from workers.trainer.micro import split_micro_batches
from workers.trainer.step import backward_step, train_step

CONVERSIONS = ("item", "tolist", "__float__", "__int__", "__bool__")


@contextlib.contextmanager
def count_conversions():
    calls = {name: 0 for name in CONVERSIONS}
    saved = {name: getattr(torch.Tensor, name) for name in CONVERSIONS}

    def counting(name):
        def wrapper(self, *args, **kwargs):
            calls[name] += 1
            return saved[name](self, *args, **kwargs)
        return wrapper

    for name in CONVERSIONS:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def syncs(dims, budget: int) -> tuple[int, dict[str, int], dict[str, int]]:
    """(micro-batches, conversion calls of one train_step, of its backward_step) at ``micro_batch_tokens=budget``."""
    cfg = moe.tcfg(micro_batch_tokens=budget)
    model = parallelize(moe.build_model(moe.CFG, moe.SEED), dims)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    batch = moe.make_batch()
    num = len(split_micro_batches(batch, budget, packed=False, dims=dims))
    train_step(model, opt, batch, cfg, dims)  # warm: lazy initialisation happens once
    with count_conversions() as calls:
        train_step(model, opt, batch, cfg, dims)
    with count_conversions() as without_optimizer:
        backward_step(model, batch, cfg, dims)
    return num, calls, without_optimizer


def test_host_syncs_do_not_grow_with_micro_batches(dims):
    """The CPU AdamW reads each parameter's step count (``.item()``, fixed per step; the fused CUDA
    AdamW the trainer builds does not): the bound is on backward_step (9 on 2026-12-03: row lengths,
    token totals, micro-batch count, grad norm, the statistics, and a few fixed ones per step)."""
    counts, backward = {}, {}
    for budget in (40, 30, 12):
        num, calls, bwd = syncs(dims, budget)
        counts[num], backward[num] = calls, bwd
    assert sorted(counts) == [2, 3, 6], f"budgets gave {sorted(counts)} micro-batches"
    assert counts[2] == counts[3] == counts[6], counts
    assert backward[2] == backward[3] == backward[6], backward
    assert sum(backward[6].values()) <= 10, f"{backward[6]}: the step reads the device more often than it needs"
