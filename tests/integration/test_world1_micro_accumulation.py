"""Gradient accumulation at world 1 (issue 45, item 2): with several micro-batches in one optimizer
step, FSDP2 casts the masters to bf16 ONCE and reduces the gradients ONCE per step
(workers/trainer/parallel/fsdp.py ``accumulate_unsharded``), and the step's gradients equal those
of the per-micro-batch cast and reduce it replaces.

A real gloo process group of one rank, bf16 compute over float32 masters (what a one-GPU trainer
runs), tiny_moe with a 30-token budget: 3 micro-batches. FSDP2's unshards (at world 1 a cast and
a copy of every master) and its gradient reductions are counted where its parameter groups run them.
"""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from tests.helpers.netutil import gloo_dims, run_ranks
from tests.integration import test_parity_parallel as moe
from workers.models.tiny_moe.model import build_model
from workers.trainer.micro import split_micro_batches
from workers.trainer.parallel.fsdp import parallelize
from workers.trainer.precision import Precision


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as group_module
    import workers.trainer.step as step_module

    torch.set_num_threads(1)
    dims = gloo_dims(rank, world, port)
    cfg = dataclasses.replace(moe.tcfg(), dtype="bfloat16", master_dtype="float32", micro_batch_tokens=30)
    calls = {"all_gather": 0, "reduce": 0}

    def counted(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    wait = group_module.FSDPParamGroup.wait_for_unshard

    def counted_wait(self, *a, **k):  # at world 1 FSDP2's all-gather is this call's cast + copy
        if self._all_gather_result is not None:
            calls["all_gather"] += 1
        return wait(self, *a, **k)

    group_module.FSDPParamGroup.wait_for_unshard = counted_wait
    group_module.foreach_reduce = counted("reduce", group_module.foreach_reduce)
    deferring = step_module.accumulate_unsharded
    result = {}
    try:
        for mode in ("deferred", "per_micro_batch"):
            step_module.accumulate_unsharded = deferring if mode == "deferred" else (lambda model, last: None)
            model = parallelize(build_model(moe.CFG, moe.SEED), dims, precision=Precision.of(cfg))
            batch = moe.make_batch()
            num_micro = len(split_micro_batches(batch, cfg.micro_batch_tokens, packed=False, dims=dims))
            calls.update(all_gather=0, reduce=0)
            stats = step_module.backward_step(model, batch, cfg, dims)
            result[mode] = {"calls": dict(calls), "grads": model.full_grad_dict(), "loss": stats["loss"],
                            "num_micro": num_micro, "groups": len(model.model.layers) + 1}
        torch.save(result, out)
    finally:
        step_module.accumulate_unsharded = deferring
        group_module.FSDPParamGroup.wait_for_unshard = wait
        dist.destroy_process_group()


def test_one_cast_and_one_reduce_per_step_with_the_same_gradients(tmp_path):
    out = str(tmp_path / f"micro_{time.monotonic_ns()}.pt")
    # spawn: a fresh interpreter. A forked rank inherits the pytest process's threads' locks (earlier tests
    # leave engine and executor threads), and once in CI its first torch op waited on one forever.
    run_ranks(_worker, 1, (out,), what="world-1 micro-batch accumulation", timeout_s=180.0, start_method="spawn")
    got = torch.load(out)
    deferred, each = got["deferred"], got["per_micro_batch"]
    assert deferred["num_micro"] == 3
    groups = deferred["groups"]
    assert each["calls"] == {"all_gather": 3 * groups, "reduce": 3 * groups}, "the path it replaces"
    assert deferred["calls"] == {"all_gather": groups, "reduce": groups}
    assert deferred["loss"] == each["loss"]
    assert deferred["grads"].keys() == each["grads"].keys()
    for name, g in deferred["grads"].items():
        assert g.dtype == torch.float32, name
        torch.testing.assert_close(g, each["grads"][name], rtol=1e-6, atol=1e-9, msg=name)
    assert any(float(g.abs().max()) > 0 for g in deferred["grads"].values())
