"""Rollout ledger (workers/orchestrator/ledger.py): every group trained at most once, none lost,
and a restarted orchestrator sees exactly the groups it must run again."""
from __future__ import annotations

import json

import pytest

from workers.common.protocol import READY
from workers.orchestrator.ledger import Ledger, read_ledger


def test_replay_gives_pending_and_next_step(tmp_path):
    led = Ledger(tmp_path / "l.jsonl")
    for g in range(6):
        led.launch(g, task_id=100 + g, worker=g % 2)
    led.resubmit(1, worker=0, reason="worker 1 died")
    assert led.next_step == 1  # steps are 1-based: the first batch is step 1's
    led.batch(1, [0, 1])
    led.drop([2])
    led.close()
    again = Ledger(tmp_path / "l.jsonl")  # a restarted orchestrator
    assert again.pending() == [3, 4, 5]
    assert again.next_step == 2 and again.groups_started == 6
    assert again.num_restarts == 1 and again.resubmits[1] == 1
    s = again.summary()
    assert s["groups_trained"] == 2 and s["groups_trained_twice"] == 0 and s["groups_dropped_stale"] == 1


def test_a_group_in_two_batches_is_refused(tmp_path):
    led = Ledger(tmp_path / "l.jsonl")
    led.launch(0, task_id=1, worker=0)
    led.batch(1, [0])
    with pytest.raises(AssertionError, match="already in batches"):
        led.batch(2, [0])
    with pytest.raises(AssertionError, match="launched twice"):
        led.launch(0, task_id=1, worker=1)


def test_torn_last_line_is_ignored(tmp_path):
    path = tmp_path / "l.jsonl"
    led = Ledger(path)
    led.launch(0, task_id=1, worker=0)
    led.close()
    with open(path, "a") as fh:
        fh.write('{"ev":"launch","gid":1,"ta')  # killed mid-write
    assert read_ledger(path).pending() == [0]


def test_recover_batch_written_but_not_recorded(tmp_path):
    """Crash window: READY renamed, the ``batch`` line never appended -> read meta.json."""
    led = Ledger(tmp_path / "l.jsonl")
    for g in range(3):
        led.launch(g, task_id=g, worker=0)
    d = tmp_path / "rollouts" / "step_000001"
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"samples": [{"group_id": 0}, {"group_id": 2}]}))
    (d / READY).write_text("{}")
    assert led.recover_batches(tmp_path) == [1]
    assert led.pending() == [1] and led.next_step == 2
    assert led.recover_batches(tmp_path) == []  # idempotent


def test_abandoned_at_end_is_not_lost(tmp_path):
    led = Ledger(tmp_path / "l.jsonl")
    led.launch(0, task_id=0, worker=0)
    led.launch(1, task_id=1, worker=0)
    led.batch(0, [0])
    led.abandon(led.pending())
    assert led.pending() == [] and led.summary()["groups_abandoned_at_end"] == 1
