"""SGLang 0.5.23's receive side of ``/update_weights_from_distributed``, reproduced on gloo.

Why here: the weight-sync benchmark (benchmarks/weight_sync.py) times our sender against this
receive path, and the fake SGLang servers of the tests (tests/fakes/fake_sglang_weights.py) receive
with it; benchmarks never import tests/, so it lives with the benchmarks and the fake imports it.
tests/unit/inference/test_sglang_weight_protocol.py checks the pinned SGLang source still does this.
"""
from __future__ import annotations


def receive_like_sglang(pg, names, dtypes, shapes, load_format=None) -> list:
    """One /update_weights_from_distributed call's receive, as WeightUpdater.receive_weights_from_distributed
    does it: per tensor (async broadcasts from rank 0 in the order of names, then wait), or one uint8
    flattened bucket (FlattenedTensorBucket.empty's layout). Returns [(name, tensor)]."""
    import torch
    import torch.distributed as dist

    if load_format == "flattened_bucket":
        sizes = [torch.Size(s).numel() * getattr(torch, d).itemsize for d, s in zip(dtypes, shapes)]
        flat = torch.empty(sum(sizes), dtype=torch.uint8)
        dist.broadcast(flat, src=0, group=pg)
        got, at = [], 0
        for n, d, s, size in zip(names, dtypes, shapes, sizes):
            got.append((n, flat[at: at + size].view(getattr(torch, d)).reshape(s)))
            at += size
        return got
    got = [(n, torch.empty(s, dtype=getattr(torch, d))) for n, d, s in zip(names, dtypes, shapes)]
    for h in [dist.broadcast(t, src=0, group=pg, async_op=True) for _, t in got]:
        h.wait()
    return got
