"""Issue 47 item 4: a checkpointed step's metrics record survives a cut or torn metrics.jsonl.

The loop writes a step's record, then saves its checkpoint; the save syncs metrics.jsonl and keeps a copy
of the record (workers/trainer/metrics_durable.py). A resume from that checkpoint whose metrics.jsonl lost
the line (cut in half, or gone) puts it back: every step once, none lost. Lines that are not step records
(or not UTF-8) are dropped, never a traceback.
"""
from __future__ import annotations

import json
import os

from tests.unit.trainer.test_checkpoint import _model_opt
from workers.trainer.checkpoint import Checkpointer
from workers.trainer.metrics_durable import BACKUP_FILE


def _write(path, steps):
    with open(path, "a") as f:
        for s in steps:
            f.write(json.dumps({"step": s, "loss": 0.1 * s}) + "\n")


def _steps(path):
    return [json.loads(x)["step"] for x in path.read_text().splitlines()]


def test_a_cut_last_line_of_a_checkpointed_step_is_put_back_on_resume(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    m, opt = _model_opt()
    metrics = tmp_path / "metrics.jsonl"
    ck = Checkpointer(tmp_path, rank=0, world_size=1, every=2, keep=2)
    for s in range(1, 5):
        _write(metrics, [s])  # the loop: record first, then end_step saves every 2 steps
        ck.end_step(s, m, opt)
    assert str(metrics) in synced  # synced with each checkpoint
    kept = [json.loads(x) for x in (tmp_path / "checkpoints" / BACKUP_FILE).read_text().splitlines()]
    assert [r["step"] for r in kept] == [2, 4] and kept[1]["loss"] == 0.4
    text = metrics.read_text()
    metrics.write_text(text[: len(text) - 12])  # step 4's line cut in half (after its checkpoint)
    assert Checkpointer(tmp_path, rank=0, world_size=1, every=2, keep=2).load(*_model_opt()) == 4
    assert _steps(metrics) == [1, 2, 3, 4] and json.loads(metrics.read_text().splitlines()[-1])["loss"] == 0.4
    resume = json.loads((tmp_path / "checkpoints" / "resumes.jsonl").read_text().splitlines()[-1])
    assert resume["step"] == 4 and resume["steps_lost"] == 0


def test_hostile_lines_are_dropped_and_missing_checkpointed_records_come_back_in_order(tmp_path):
    m, opt = _model_opt()
    metrics = tmp_path / "metrics.jsonl"
    ck = Checkpointer(tmp_path, rank=0, world_size=1, every=1, keep=3)
    for s in range(1, 4):
        _write(metrics, [s])
        ck.end_step(s, m, opt)
    lines = metrics.read_text().splitlines()
    metrics.write_bytes(b"\n".join([lines[0].encode(), b"[1, 2]", b'{"no_step": 1}', b"\xff\xfe garbage",
                                    lines[2].encode(), json.dumps({"step": 5}).encode()]) + b"\n")
    assert Checkpointer(tmp_path, rank=0, world_size=1, every=1, keep=3).load(*_model_opt()) == 3
    assert _steps(metrics) == [1, 2, 3]  # 2 put back between 1 and 3; 5 (after the checkpoint) cut
