"""Issue 47 item 1, piece by piece (the whole loop: tests/integration/test_damaged_patch_run.py).

A refused step is answered by a full step of the newest version (workers/weights/filesystem/reanchor.py):
the orchestrator's side writes the request once per refusal and tries a refused step again once it was
written again; the trainer's side (PatchPublisher.wait) writes the anchor for a refusal in its current
chain and only then. A worker that holds a step whose files went since still takes the next patch.
"""
from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

from tests.unit.weights.test_weights_patches import Receiver, _master, _publisher, _same, _train
from workers.common.protocol import step_name
from workers.weights.base import WeightLoadError
from workers.weights.coordinator import RetryPolicy
from workers.weights.filesystem.layout import INDEX
from workers.weights.filesystem.reanchor import REQUEST, Reanchor, read_request
from workers.weights.stream import DictStream

LOG = logging.getLogger("test")


def _publish(pub, master, versions):
    for v in versions:
        if v:
            _train(master, v)
        pub.publish(v, DictStream(master, dtype=torch.bfloat16))
    pub.flush()


def _format(root, v):
    return json.loads((root / step_name(v) / INDEX).read_text()).get("format")


def _request(root, seq, version, patch=True):
    (root / REQUEST).write_text(json.dumps({"seq": seq, "version": version, "patch": patch}))


def test_a_refused_step_in_the_current_chain_is_answered_by_one_full_step_at_once(tmp_path):
    master, pub = _master(), _publisher(tmp_path, full_every=10, keep_last=10)
    try:
        _publish(pub, master, range(4))  # anchor 0, patches 1..3
        assert _format(tmp_path, 3) == "slurmrl-delta/1"
        pub.wait(lambda: True, timeout_s=5, what="batch")  # no request: nothing written
        assert pub.reanchors == 0
        _request(tmp_path, 1, 2)  # v2 (a patch) was refused
        pub.wait(lambda: True, timeout_s=5, what="batch")
        pub.flush()
        assert pub.reanchors == 1 and pub.last_anchor == 3 and _format(tmp_path, 3) == "slurmrl-weights/1"
        _request(tmp_path, 2, 3)  # the old patch v3 refused too (it sat on v2): the anchor answers it already
        pub.wait(lambda: True, timeout_s=5, what="batch")
        _request(tmp_path, 3, 1)  # an older chain's patch: nothing to do
        pub.wait(lambda: True, timeout_s=5, what="batch")
        assert pub.reanchors == 1
        _request(tmp_path, 4, 3, patch=False)  # the anchor itself refused: written again
        pub.wait(lambda: True, timeout_s=5, what="batch")
        assert pub.reanchors == 2
        _publish(pub, master, [4])  # the chain goes on from the anchor out of turn
        index = json.loads((tmp_path / step_name(4) / INDEX).read_text())
        assert (index["base"], index["anchor"]) == (3, 3)
    finally:
        pub.close()
    fresh = Receiver(master)
    fresh.load(tmp_path / step_name(4))
    assert _same(fresh, master)
    assert pub._metrics(0.0, 0, 0.0)["weight_reanchors_total"] == 2


def test_the_trainer_still_times_out_naming_the_orchestrator(tmp_path):
    master, pub = _master(), _publisher(tmp_path)
    try:
        _publish(pub, master, [0])
        with pytest.raises(TimeoutError, match="orchestrator"):
            pub.wait(lambda: False, timeout_s=0.2, what="training batch")
    finally:
        pub.close()


def test_the_orchestrator_asks_once_per_refusal_and_retries_a_step_written_again(tmp_path):
    master, pub = _master(), _publisher(tmp_path, full_every=10, keep_last=10)
    _publish(pub, master, range(3))
    retry = RetryPolicy()
    o = Reanchor(tmp_path, retry, enabled=True, log=LOG)
    o.trying(2)
    retry.failed(2, content=True)
    o.refused(2, "checksum")
    assert read_request(tmp_path) == (1, 2, True)
    o.forget_rewritten()
    assert 2 in retry.refused  # not written again: stays refused
    _request(tmp_path, 1, 2)
    pub.wait(lambda: True, timeout_s=5, what="batch")  # the trainer answers
    pub.close()
    o.forget_rewritten()
    assert 2 not in retry.refused and retry.due(2)
    o.trying(2)
    retry.failed(2, content=True)
    os.utime(tmp_path / step_name(2) / "STABLE", ns=(1, 1))  # written again while being refused: no request
    o.refused(2, "raced")
    assert read_request(tmp_path)[0] == 1 and o.requested == 1
    assert Reanchor(tmp_path, RetryPolicy(), enabled=True, log=LOG).seq == 1  # a restart goes on counting
    off = Reanchor(tmp_path, retry, enabled=False, log=LOG)  # weights.delta=false: no request
    off.trying(1)
    off.refused(1, "x")
    assert read_request(tmp_path)[0] == 1
    (tmp_path / REQUEST).write_text("not json")
    assert read_request(tmp_path) == (0, -1, True)


def test_a_worker_holding_a_step_whose_files_went_since_takes_the_next_patch(tmp_path):
    master, pub = _master(), _publisher(tmp_path, full_every=10, keep_last=10)
    holder, behind = Receiver(master), Receiver(master)
    for v in range(4):
        _publish(pub, master, [v])
        if v <= 2:
            holder.load(tmp_path / step_name(v))
        if v <= 1:
            behind.load(tmp_path / step_name(v))
    pub.close()
    shutil.rmtree(tmp_path / step_name(2))  # deleted after the holder loaded it
    got = holder.load(tmp_path / step_name(3))
    assert len(got.patches) == 1 and _same(holder, master)
    before = {n: t.clone() for n, t in behind.params.items()}
    with pytest.raises(WeightLoadError, match="digest"):  # one that holds v1 cannot skip v2: refused, kept
        behind.load(tmp_path / step_name(3))
    assert all(torch.equal(before[n], t) for n, t in behind.params.items())
    behind.sums = None  # what the engine keeps after that refusal: the anchor path, which needs v2
    with pytest.raises(WeightLoadError, match="no STABLE"):
        behind.load(tmp_path / step_name(3))
    holder.sums = {n: s ^ 1 for n, s in holder.sums.items()}  # sums that fit nothing: the walk's own refusal
    with pytest.raises(WeightLoadError, match="no STABLE"):
        holder.load(tmp_path / step_name(3))
