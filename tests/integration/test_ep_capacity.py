"""The fixed-capacity expert-parallel dispatch (workers/trainer/parallel/expert_capacity.py) on real gloo ranks.

Without overflow the step is the exact dispatch's, so the one-process float32 reference of
tests/integration/test_parity_mesh.py pins it (loss, gradient norm, clipped gradients, weights after
AdamW), Router Replay on (forced random experts: rows move every way), at ep 2 and 4, with tp, and
with micro-batches (a padding micro-batch of one token still joins every all-to-all) under
selective checkpointing (the recompute replays the dispatch). A tiny factor forces overflow: the
step is redone with the exact dispatch, gives the reference's result and counts the redo. On the GPU
code path (bfloat16 grouped GEMMs, kernels.FAST_PATH_ON_CPU) a MoE block reads nothing on the host.
"""
from __future__ import annotations


import functools

import pytest
import torch
import torch.distributed as dist

from tests.integration import test_parity_mesh as mesh
from tests.integration import test_parity_parallel as moe
from tests.integration.step_parity import assert_step_matches
from tests.helpers.netutil import gloo_dims
from workers.trainer.parallel import expert, expert_capacity
from workers.trainer.batch import shard_rows
from workers.trainer.step import backward_step

SELECTIVE = {"micro_batch_tokens": 16, "activation_checkpointing": "selective"}
CASES = [("qwen3_moe", 1, 1, 2, None), ("deepseek_v3", 1, 1, 4, None), ("qwen3_moe", 1, 2, 2, None),
         ("deepseek_v3", 2, 1, 2, SELECTIVE)]


def _reference(model: str) -> dict:
    if model not in mesh._REFS:
        torch.set_num_threads(1)
        mesh._REFS[model] = mesh.reference(model)
    return mesh._REFS[model]


@pytest.mark.parametrize("model,dp,tp,ep,extra", CASES,
                         ids=[f"{c[0]}-dp{c[1]}-tp{c[2]}-ep{c[3]}" + ("-micro-selective" if c[4] else "") for c in CASES])
def test_fixed_capacity_dispatch_matches_the_one_process_step(tmp_path, model, dp, tp, ep, extra):
    """Factor ep (C >= every rank's slots): no overflow possible, every MoE block takes the fixed path."""
    out = str(tmp_path / "got.pt")
    mesh.spawn(mesh._worker, dp * tp * ep, (tp, ep, model, out, extra, float(ep)))
    got = torch.load(out)
    assert len(got["fixed"]) > 0, "the MoE blocks ran the fixed-capacity exchange"
    assert got["stats"]["ep_overflow_steps"] == 0
    assert_step_matches(got, _reference(model))


def test_overflow_redoes_the_step_with_the_exact_dispatch(tmp_path):
    """Factor 0.01: C is 8 rows per peer, far below the ~40 slots a rank has for each of 2 peers. The
    truncated first pass is thrown away: the step's result is the exact one, and the redo is counted."""
    out = str(tmp_path / "got.pt")
    mesh.spawn(mesh._worker, 2, (1, 2, "qwen3_moe", out, None, 0.01))
    got = torch.load(out)
    assert len(got["fixed"]) > 0, "the first pass ran the fixed-capacity exchange"
    assert got["stats"]["ep_overflow_steps"] == 1
    assert_step_matches(got, _reference("qwen3_moe"))


def test_capacity_rounds_up_to_eight_and_splits_tokens_over_tp():
    assert expert_capacity.capacity(100, factor=2.0, top_k=2, ep=4, tp=1) == 104  # ceil(2 * 200 / 4) = 100 -> 104
    assert expert_capacity.capacity(100, factor=2.0, top_k=2, ep=4, tp=2) == 56  # 50 tokens per tp rank
    assert expert_capacity.capacity(1, factor=0.01, top_k=1, ep=8, tp=1) == 8


def _guard_host_reads(factor: float) -> None:
    """In this rank: inside every MoE block, a host read (tolist, item, bool, int, float) raises
    (with the fixed-capacity dispatch; factor 0 is the exact dispatch, which reads split sizes)."""
    inside = []
    call = expert.ExpertParallel.__call__

    def guarded(self, *args):
        inside.append(1)
        try:
            return call(self, *args)
        finally:
            inside.pop()

    def refuse(name):
        original = getattr(torch.Tensor, name)

        def read(t, *args):
            if inside:
                raise AssertionError(f"host sync ({name}) inside a MoE block")
            return original(t, *args)
        return read
    expert.ExpertParallel.__call__ = guarded
    if factor:
        for name in ("tolist", "item", "__bool__", "__int__", "__float__"):
            setattr(torch.Tensor, name, refuse(name))


def _no_sync_worker(rank, world, port, tp, ep, model_name, out, factor):
    """bfloat16 on the fast path (test_parity_mesh._fast_worker) under :func:`_guard_host_reads`."""
    mesh._fast_worker(rank, world, port, tp, ep, model_name, out, factor, functools.partial(_guard_host_reads, factor))


def test_fast_path_blocks_read_nothing_on_the_host(tmp_path):
    """tp 1 x ep 2 on the GPU code path with factor 2 (no tolist / item in any MoE block, forward or
    backward) against the exact dispatch on the same path: the same step up to bfloat16 rounding."""
    got = {}
    for factor in (0.0, 2.0):
        out = str(tmp_path / f"{factor}.pt")
        mesh.spawn(_no_sync_worker, 2, (1, 2, "qwen3_moe", out, factor))
        got[factor] = torch.load(out)["stats"]
    assert got[2.0]["ep_overflow_steps"] == 0
    for key in ("loss", "grad_norm", "aux_loss"):
        assert got[2.0][key] == pytest.approx(got[0.0][key], rel=2e-2, abs=1e-3), key


def _exchange_count_worker(rank, world, port, tp, ep, model_name, out):
    """All-to-alls of rows that actually ran in one step, per activation-checkpointing mode."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from workers.trainer.micro import apply_activation_checkpointing
    from workers.trainer.parallel.mesh import parallelize

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func is torch.ops._c10d_functional.all_to_all_single.default
            return func(*args, **(kwargs or {}))
    torch.set_num_threads(1)
    dims = gloo_dims(rank, world, port, tp=tp, ep=ep)
    got = {}
    try:
        for mode in ("none", "full", "selective"):
            full = moe.build_model(moe.CONFIGS[model_name], moe.SEED)
            apply_activation_checkpointing(full.model.layers, mode)
            model = parallelize(full, dims)
            expert_capacity.configure(model, 2.0)
            batch = shard_rows(moe.make_batch(model=model_name), dims.batch_rank, dims.num_batch_shards)
            with Count() as c:
                backward_step(model, batch, moe.tcfg(activation_checkpointing=mode), dims)
            got[mode] = c.n
        if rank == 0:
            torch.save(got, out)
    finally:
        dist.destroy_process_group()


def test_selective_checkpointing_keeps_the_exchanged_rows(tmp_path):
    """Selective recompute takes the dispatch/combine all-to-alls' rows from the store: as many row
    exchanges as without checkpointing; full checkpointing moves every row again."""
    out = str(tmp_path / "n.pt")
    mesh.spawn(_exchange_count_worker, 2, (1, 2, "qwen3_moe", out))
    n = torch.load(out)
    assert n["none"] > 0 and n["selective"] == n["none"] < n["full"], n
