"""Trainer checkpoints (workers/trainer/checkpoint.py): atomic, resumable, incomplete ones skipped."""
from __future__ import annotations

import json
import os
import random
import shutil

import torch

from workers.trainer.checkpoint import Checkpointer, complete_checkpoints


def _model_opt(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    return m, opt


def test_save_then_load_restores_model_optimizer_rng_and_step(tmp_path):
    m, opt = _model_opt()
    ck = Checkpointer(tmp_path, rank=0, world_size=1, every=2, keep=2)
    ck.begin_step()
    ck.end_step(2, m, opt)  # step 2 (1-based) trained -> 2 done -> due
    torch_rng, py_rng = torch.rand(3), random.random()  # drawn after the save: a resume must redraw them
    m2, opt2 = _model_opt(seed=1)
    start = Checkpointer(tmp_path, rank=0, world_size=1, every=2, keep=2).load(m2, opt2)
    assert start == 2
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values()))
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    assert torch.equal(torch.rand(3), torch_rng) and random.random() == py_rng


def test_incomplete_and_corrupt_checkpoints_are_skipped(tmp_path):
    m, opt = _model_opt()
    ck = Checkpointer(tmp_path, rank=0, world_size=1, every=0, keep=5)
    ck.save(2, m, opt)
    ck.save(4, m, opt)
    root = tmp_path / "checkpoints"
    shutil.copytree(root / "step_000004", root / ".step_000006.tmp")  # killed before the rename
    os.remove(root / ".step_000006.tmp" / "COMPLETE")
    (root / "step_000004" / "rank_0.pt").write_bytes(b"torn")  # corrupt newest complete one
    start = Checkpointer(tmp_path, rank=0, world_size=1, every=0, keep=5).load(*_model_opt(1))
    assert start == 2
    resume = json.loads((root / "resumes.jsonl").read_text().splitlines()[-1])
    assert ".step_000006.tmp" in resume["skipped"] and "step_000004" in resume["skipped"]


def test_multi_rank_checkpoint_is_complete_only_with_every_rank(tmp_path):
    m, opt = _model_opt()
    r0 = Checkpointer(tmp_path, rank=0, world_size=2, every=0, keep=2)
    r1 = Checkpointer(tmp_path, rank=1, world_size=2, every=0, keep=2)
    r0.save(3, m, opt)
    assert complete_checkpoints(tmp_path / "checkpoints", 2) == []  # rank 1 not there yet: not visible
    r1.save(3, m, opt)
    assert complete_checkpoints(tmp_path / "checkpoints", 2) == [3]
    assert Checkpointer(tmp_path, rank=0, world_size=1, every=0, keep=2).load(*_model_opt()) == 0  # other layout


def test_retention_and_metrics_rewind(tmp_path):
    m, opt = _model_opt()
    ck = Checkpointer(tmp_path, rank=0, world_size=1, every=1, keep=2)
    for s in range(1, 5):  # 1-based steps: checkpoints/step_N is the state after step N
        ck.end_step(s, m, opt)
    assert complete_checkpoints(tmp_path / "checkpoints", 1) == [3, 4]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 7)) + '{"st')
    assert Checkpointer(tmp_path, rank=0, world_size=1, every=1, keep=2).load(*_model_opt()) == 4
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert ck.prune_bound(10) == 4 + 2  # prune_rollouts keeps newest - 1 ..: batches from step 5 on, for a resume
