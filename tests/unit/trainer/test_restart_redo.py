"""Redone steps are cut from metrics.jsonl and counted, also when a restart begins from step 0
(issue 35 item 3): a trainer restarted before its first checkpoint used to append steps 1..k
again (``[1, 2, 1, 2, 3, ...]``) with no ``resumes.jsonl`` entry, and the launcher then said
"finished: 12 steps" for a 10-step run."""
from __future__ import annotations

import json

import torch

from launcher.progress import ProgressPrinter
from workers.common.protocol import RunPaths
from workers.trainer.checkpoint import RESUMES_FILE, Checkpointer


def _model_opt():
    m = torch.nn.Linear(2, 2)
    return m, torch.optim.AdamW(m.parameters(), lr=0.1)


def _metrics(root, steps):
    (root / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward_mean": 0.1 * s}) + "\n" for s in steps))


def _resumes(root):
    path = root / "checkpoints" / RESUMES_FILE
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_restart_before_the_first_checkpoint_rewinds_metrics_and_counts_the_redo(tmp_path):
    _metrics(tmp_path, [1, 2])
    start = Checkpointer(tmp_path, rank=0, world_size=1, every=5, keep=2).load(*_model_opt())
    assert start == 0
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    (entry,) = _resumes(tmp_path)
    assert entry["step"] == 0 and entry["steps_lost"] == 2


def test_restart_before_any_metrics_is_still_a_resume(tmp_path):
    """Killed during step 1 (step 0 published, no record yet): nothing to cut, but the resume is counted."""
    (tmp_path / "weights" / "step_000000").mkdir(parents=True)
    (tmp_path / "weights" / "step_000000" / "STABLE").write_text("{}")
    assert Checkpointer(tmp_path, rank=0, world_size=1, every=5, keep=2).load(*_model_opt()) == 0
    assert [(e["step"], e["steps_lost"]) for e in _resumes(tmp_path)] == [(0, 0)]


def test_a_first_start_is_not_a_resume(tmp_path):
    assert Checkpointer(tmp_path, rank=0, world_size=1, every=5, keep=2).load(*_model_opt()) == 0
    assert _resumes(tmp_path) == [] and not (tmp_path / "metrics.jsonl").exists()


def test_only_rank_0_rewinds_and_counts(tmp_path):
    _metrics(tmp_path, [1, 2, 3])
    assert Checkpointer(tmp_path, rank=1, world_size=2, every=5, keep=2).load(*_model_opt()) == 0
    assert _resumes(tmp_path) == [] and len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_progress_counts_each_step_once(tmp_path, capsys):
    """Whatever reaches metrics.jsonl (a rewind the printer missed), the summary counts distinct steps."""
    paths = RunPaths(tmp_path)
    _metrics(tmp_path, [1, 2, 1, 2, 3])
    p = ProgressPrinter(paths, num_steps=3)
    p.poll()
    assert p.summary().startswith("3 steps"), p.summary()
    _metrics(tmp_path, [])  # a rewind to step 0 (a new file)
    p.poll()
    assert p.summary().startswith("0 steps"), p.summary()
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n")
    p.poll()
    assert p.summary().startswith("1 steps"), p.summary()
