"""A checkpoint of the FSDP plan saved at dp 2 resumes at dp 1 and dp 4 on the same loss curve.

Real gloo processes (spawned, a free port each). dp 2 trains step 0, saves through the trainer's
Checkpointer (torch.distributed.checkpoint: workers/trainer/dcp_state.py), then trains step 1:
that is the curve to continue. Each other layout builds the model from ANOTHER seed (so only the
checkpoint can make it right), loads the checkpoint, and trains step 1 on the same batch: the
loss, the grad norm and every weight after AdamW must be dp 2's (float32 rounding of the sums).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from tests.integration import test_parity_parallel as moe
from tests.helpers.netutil import gloo_dims, run_ranks
from workers.models.tiny_moe.model import build_model
from workers.trainer.batch import shard_rows
from workers.trainer.checkpoint import Checkpointer
from workers.trainer.parallel.fsdp import parallelize
from workers.trainer.step import train_step


def _worker(rank: int, world: int, port: int, run_dir: str, phase: str, out: str) -> None:
    torch.set_num_threads(1)
    dims = gloo_dims(rank, world, port)
    cfg = dataclasses.replace(moe.tcfg(), lr=1e-3)
    try:
        model = parallelize(build_model(moe.CFG, moe.SEED if phase == "save" else 99), dims)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas))
        ckpt = Checkpointer(run_dir, rank=rank, world_size=world, every=0, keep=2)
        if phase == "signal":  # SIGUSR1 reached rank 0 only: the ranks agree, both save
            ckpt.save_requested = rank == 0
            ckpt.begin_step()
            ckpt.end_step(1, model, opt)  # step 1 (1-based) trained
            if rank == 0:
                torch.save({"resume_step": ckpt.resume_step}, out)
            return
        if phase == "save":
            train_step(model, opt, shard_rows(moe.make_batch(seed=0), dims.batch_rank, dims.num_batch_shards), cfg, dims)
            ckpt.save(1, model, opt)
            start = 1
        else:
            start = ckpt.load(model, opt)
        stats = train_step(model, opt, shard_rows(moe.make_batch(seed=1), dims.batch_rank, dims.num_batch_shards),
                           cfg, dims)
        weights = model.full_state_dict()
        if rank == 0:
            torch.save({"start": start, "stats": stats, "weights": weights}, out)
    finally:
        dist.destroy_process_group()


def run(tmp_path, world: int, phase: str) -> dict:
    out = str(tmp_path / f"{phase}_{world}.pt")
    run_ranks(_worker, world, (str(tmp_path / "run"), phase, out), what=f"{phase} at world {world}")
    return torch.load(out)


def test_saved_at_dp2_resumes_at_dp1_and_dp4_on_the_same_curve(tmp_path):
    base = run(tmp_path, 2, "save")
    assert next((tmp_path / "run" / "checkpoints").glob("step_*/dcp/.metadata"), None) is not None
    for world in (1, 4):
        got = run(tmp_path, world, "load")
        assert got["start"] == 1, f"dp {world} did not resume from the dp 2 checkpoint"
        assert got["stats"]["loss"] == pytest.approx(base["stats"]["loss"], rel=1e-5)
        assert got["stats"]["grad_norm"] == pytest.approx(base["stats"]["grad_norm"], rel=1e-5)
        for name, w in base["weights"].items():
            err = float((got["weights"][name] - w).abs().max())
            assert err < 1e-5, f"dp {world}: {name} differs by {err:.3g} after the resumed step"


def test_a_signal_on_one_rank_saves_on_every_rank(tmp_path):
    got = run(tmp_path, 2, "signal")
    assert got["resume_step"] == 1
    assert next((tmp_path / "run" / "checkpoints").glob("step_*/COMPLETE"), None) is not None
