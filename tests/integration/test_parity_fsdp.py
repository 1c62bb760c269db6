"""Parity of the generic FSDP2 plan (workers/trainer/parallel/fsdp.py) with the one-process fp32 step.

Each layout runs as real gloo processes (spawned, a free port each): the seeded full model in
float32 master weights is ``fully_shard``-ed over dp_shard ranks, each rank takes its row shard
and runs the trainer's ``backward_step`` (micro-batches, activation checkpointing, Router Replay
as configured) and one AdamW step on its shards; rank 0 gathers the full gradients and weights
(``DTensor.full_tensor`` per parameter). The reference is test_parity_parallel's plain model with
the loss functions called directly. tiny_moe (routed, Router Replay on) and llama (dense, tied
embeddings, GQA) both run: the plan only knows ``CausalLM``.
"""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist

from tests.integration import test_parity_dense as dense
from tests.integration import test_parity_parallel as moe
from tests.integration.step_parity import assert_step_matches
from tests.helpers.netutil import gloo_dims, run_ranks
from workers.common.config import TrainerConfig
from workers.models.tiny_moe.model import build_model
from workers.trainer.batch import shard_rows
from launcher.estimate import ParamCount, trainer_memory
from workers.trainer.parallel.fsdp import parallelize, sharded_bytes
from workers.trainer.compile import apply_compile
from workers.trainer.micro import apply_activation_checkpointing, split_micro_batches
from workers.trainer.precision import Precision
from workers.trainer.step import backward_step

FAMILIES = {"tiny_moe": (moe.CFG, moe.SEED, moe.make_batch), "llama": (dense.CFG, dense.SEED, dense.make_batch)}


def _worker(rank: int, world: int, port: int, family: str, cfg: TrainerConfig, out: str) -> None:
    torch.set_num_threads(1)
    mcfg, seed, make_batch = FAMILIES[family]
    dims = gloo_dims(rank, world, port)
    try:
        full = build_model(mcfg, seed)
        apply_activation_checkpointing(full.model.layers, cfg.activation_checkpointing)
        apply_compile(full.model.layers, cfg.compile, backend="aot_eager")  # trainer.compile; auto: none on CPU
        model = parallelize(full, dims, precision=Precision.of(cfg))
        local = {n: p.to_local().numel() for n, p in model.named_parameters()}
        shard = shard_rows(make_batch(), dims.batch_rank, dims.num_batch_shards)
        num_micro = len(split_micro_batches(shard, cfg.micro_batch_tokens, packed=False, dims=dims))
        stats = backward_step(model, shard, cfg, dims)
        grads = model.full_grad_dict()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas))
        opt.step()
        state = torch.tensor([sharded_bytes(model, opt)], dtype=torch.float64)
        dist.all_reduce(state, op=dist.ReduceOp.MAX)
        weights = model.full_state_dict()
        if rank == 0:
            torch.save({"stats": stats, "grads": grads, "weights": weights, "local": local, "num_micro": num_micro,
                        "state_bytes": float(state)}, out)
    finally:
        dist.destroy_process_group()


def run_fsdp(tmp_path, family: str, world: int, cfg: TrainerConfig, timeout_s: float = 180.0) -> dict:
    out = str(tmp_path / f"{family}_w{world}_{time.monotonic_ns()}.pt")
    run_ranks(_worker, world, (family, cfg, out), what=f"FSDP {family}", timeout_s=timeout_s)
    return torch.load(out)


def reference(family: str) -> dict:
    """The one-process step; ``clipped``: its gradients after clipping (what the trainer ends with)."""
    if family == "llama":  # test_parity_dense's reference keeps the gradients after clipping already
        r = dense.reference()
        assert r["grad_norm"] > dense.TCFG.grad_clip, "grad_clip below the norm: clipping is exercised"
        return {**r, "clipped": r["grads"]}
    cfg = moe.tcfg()
    r = moe.reference(moe.make_batch(), cfg)
    scale = min(1.0, cfg.grad_clip / (r["grad_norm"] + 1e-6))
    assert scale < 1.0, "grad_clip below the norm: clipping is exercised"
    return {**r, "clipped": {n: g * scale for n, g in r["grads"].items()}}


def trainer_cfg(family: str, **kw) -> TrainerConfig:
    return dataclasses.replace(moe.tcfg() if family == "tiny_moe" else dense.TCFG, **kw)


# (family, world, micro_batch_tokens, activation_checkpointing, micro-batches per rank). The 8 rows
# are 5-10 tokens long: at dp 2 a 16-token budget cuts rank 0's rows into 3 micro-batches and rank
# 1's into 2 (+1 padding micro-batch: every rank runs as many); at dp 4 only rank 2 needs 2.
LAYOUTS = [("tiny_moe", 1, 0, "none", 1), ("tiny_moe", 2, 0, "none", 1), ("tiny_moe", 2, 16, "full", 3),
           ("tiny_moe", 1, 30, "none", 3), ("tiny_moe", 4, 0, "full", 1), ("tiny_moe", 4, 16, "none", 2),
           ("tiny_moe", 2, 16, "selective", 3), ("llama", 2, 0, "none", 1), ("llama", 2, 16, "full", 3),
           ("llama", 1, 0, "selective", 1)]


@pytest.fixture(scope="module")
def refs() -> dict:
    torch.set_num_threads(1)
    return {f: reference(f) for f in FAMILIES}


@pytest.mark.parametrize("family,world,mbt,ac,num_micro", LAYOUTS,
                         ids=[f"{f}-dp{w}-mbt{m}-ac{a}" for f, w, m, a, _ in LAYOUTS])
def test_fsdp_matches_one_process_reference(tmp_path, refs, family, world, mbt, ac, num_micro):
    # at dp 2 the log-probs are scored 5 positions at a time (chunks recomputed in the backward, inside
    # FSDP's root forward and activation checkpointing); elsewhere all at once
    chunk = 5 if world == 2 else 0
    got = run_fsdp(tmp_path, family, world, trainer_cfg(family, micro_batch_tokens=mbt, activation_checkpointing=ac,
                                                        logprob_chunk_tokens=chunk))
    assert got["num_micro"] == num_micro
    assert_step_matches(got, refs[family], weights="all", grad_names=False)
    total = sum(p.numel() for p in refs[family]["weights"].values())
    assert sum(got["local"].values()) <= total // world + 64 * len(got["local"]), "each rank holds ~1/world"
    planned = trainer_memory(ParamCount(total=total, active=total, mtp=0), world, 141.0).per_gpu_gb * 1e9
    assert got["state_bytes"] == pytest.approx(planned, rel=0.25), "the planner's per-GPU state (launcher/estimate.py)"


def test_bfloat16_compute_over_float32_masters_tracks_the_float32_step(tmp_path, refs):
    """Mixed precision at dp 2 (bf16 forward/backward, fp32 reduce-scatter into fp32 masters): the
    loss, norm and update stay within bf16 rounding of the fp32 reference, and the masters move
    by the fp32 AdamW step (a bf16 weight could not hold most of them)."""
    got = run_fsdp(tmp_path, "tiny_moe", 2, trainer_cfg("tiny_moe", dtype="bfloat16", micro_batch_tokens=16))
    ref = refs["tiny_moe"]
    assert got["stats"]["loss"] == pytest.approx(ref["loss"], rel=0.05, abs=1e-3)
    assert got["stats"]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=0.05)
    lr = moe.tcfg().lr  # AdamW's first step moves each weight by ~lr * sign(grad): a bf16-flipped sign costs 2 lr
    off = total = 0
    for name, w in ref["weights"].items():
        assert got["weights"][name].dtype == torch.float32, name
        diff = (got["weights"][name] - w).abs()
        assert float(diff.max()) <= 2.02 * lr, name
        off, total = off + int((diff > 0.5 * lr).sum()), total + w.numel()
    assert off / total < 0.05, f"{off / total:.1%} of the weights took another step than the fp32 reference"
