"""The real trainer loop (``python -m workers.trainer``) at tp=2 x ep=2 on 4 gloo ranks
publishes the same weights as the 1-rank loop, batch after batch.

This is the wiring check on top of test_parity_parallel.py (which compares one step's
gradients in-process): degrees read from ``launcher.trainer``, rows sharded over
ep x dp, the full HF state dict gathered from the shards for every published step,
metrics (grad_norm, mismatch_kl, per-layer expert load) reduced over the right groups.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.integration.conftest import RANKS_MODEL as MODEL, make_batch, publish_batch, start_rank, wait_all

from tests.helpers.netutil import free_port
from workers.common.config import (ClusterConfig, ParallelConfig, RunConfig, TrainerConfig,
                                   WeightsConfig)
from workers.models.tiny_moe.config import TinyMoeConfig
from workers.common.protocol import RunPaths
from workers.orchestrator.envs.reverse_digits import ReverseDigitsConfig
from workers.weights.filesystem.receiver import load_step


def write_run(root: Path, *, num_ranks: int, tp: int, ep: int, num_steps: int, cp: int = 1, **trainer) -> RunPaths:
    paths = RunPaths(root).ensure()
    cfg = RunConfig(cluster=ClusterConfig(name="local"), model=TinyMoeConfig(**MODEL), env=ReverseDigitsConfig(),
                    trainer=TrainerConfig(num_ranks=num_ranks, num_steps=num_steps, lr=3e-3, router_replay=True,
                                          batch_timeout_s=60.0, parallel=ParallelConfig(tp=tp, ep=ep, cp=cp), **trainer),
                    weights=WeightsConfig(keep_last=5))
    paths.run_config.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    return paths


def run_against_one_rank(tmp_path, num_ranks: int, steps: int, **layout):
    """The same batches through the loop at ``num_ranks`` with ``layout`` and at 1 rank; (par, ref) paths."""
    par = write_run(tmp_path / "par", num_ranks=num_ranks, num_steps=steps, **layout)
    ref = write_run(tmp_path / "ref", num_ranks=1, tp=1, ep=1, num_steps=steps)
    for s in range(1, steps + 1):
        tensors, meta = make_batch(s)
        publish_batch(par, s, tensors, meta)
        publish_batch(ref, s, tensors, meta)
    port_par, port_ref = free_port(), free_port()
    procs = [start_rank(par, r, num_ranks, port_par) for r in range(num_ranks)] + [start_rank(ref, 0, 1, port_ref)]
    wait_all(procs, [par, ref], timeout_s=120.0)
    return par, ref


def assert_same_run(par, ref, steps: int, keys: tuple[str, ...], what: str) -> None:
    """Every published step's weights within 2e-6 and the metrics' ``keys`` within 1e-5 of the 1-rank run."""
    for s in range(steps + 1):
        a, b = load_step(par.weights(s)), load_step(ref.weights(s))  # whatever file layout the publisher uses
        assert sorted(a) == sorted(b) and all(a[n].shape == b[n].shape and a[n].dtype == b[n].dtype for n in a)
        worst = max(float((a[n] - b[n]).abs().max()) for n in a)
        assert worst < 2e-6, f"step {s}: {what} weights differ from the 1-rank loop by {worst:.3g}"
    recs = [[json.loads(line) for line in p.metrics.read_text().splitlines()] for p in (par, ref)]
    for rp, rr in zip(*recs):
        for key in keys:
            assert rp[key] == pytest.approx(rr[key], rel=1e-5, abs=1e-7), key


def test_tp2_ep2_loop_publishes_the_one_rank_weights(tmp_path):
    par, ref = run_against_one_rank(tmp_path, 4, 2, tp=2, ep=2)
    assert_same_run(par, ref, 2, ("loss", "grad_norm", "mismatch_kl", "aux_loss", "routing_disagreement",
                                  "num_loss_tokens", "expert_load_max_l0", "expert_load_min_l1"), "tp2 x ep2")
    assert "tp 2 x cp 1 x ep 2 x dp 1 (gloo, cpu)" in (par.logs_dir / "trainer_0.log").read_text()
    steps = [json.loads(line) for line in par.metrics.read_text().splitlines()]
    assert [r["ep_overflow_steps"] for r in steps] == [0, 0], "the default fixed-capacity EP dispatch, no redo"


def test_fsdp_dp2_loop_with_micro_batches_and_checkpointing_publishes_the_one_rank_weights(tmp_path):
    """The FSDP plan (tp = ep = 1) through the real loop: 2 ranks, ~3 micro-batches each, every layer
    recomputed in the backward, against the 1-rank loop with neither."""
    par, ref = run_against_one_rank(tmp_path, 2, 2, tp=1, ep=1, micro_batch_tokens=20,
                                    activation_checkpointing="full")
    assert_same_run(par, ref, 2, ("loss", "grad_norm", "aux_loss", "routing_disagreement", "num_loss_tokens",
                                  "expert_load_max_l0"), "FSDP dp2")
    assert "plan fsdp" in (par.logs_dir / "trainer_0.log").read_text()
