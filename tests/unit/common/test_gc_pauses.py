"""The garbage collector in long-lived roles (workers/common/gc_pauses.py): start-up objects frozen, pauses measured.

Checks: after ``settle`` the objects that existed are in the permanent generation and a full collection
no longer walks them (it finds far fewer objects to examine); every later collection is counted, full
ones apart; the heartbeat carries the numbers; a second ``settle`` keeps one watcher.
"""
from __future__ import annotations

import gc
import logging

import pytest

from workers.common import gc_pauses
from workers.common.heartbeat import Heartbeat


@pytest.fixture(autouse=True)
def _undo_settle():
    gc_pauses.reset_for_tests()
    yield
    gc_pauses.reset_for_tests()


class _Node:
    def __init__(self):
        self.me = self  # a cycle: only the collector frees it


def test_settle_freezes_what_exists_and_later_full_collections_skip_it(caplog):
    keep = [{"i": i} for i in range(20000)]  # start-up state the role keeps
    assert gc_pauses.pauses() == {}  # nothing measured before settle
    with caplog.at_level(logging.INFO):
        gc_pauses.settle(logging.getLogger("t"), role="trainer")
    assert gc.get_freeze_count() >= len(keep)
    assert "trainer: garbage collector:" in caplog.text and "start-up objects frozen" in caplog.text
    tracked = len(gc.get_objects())  # the frozen objects are no longer in any generation
    assert tracked < len(keep)


def test_every_collection_after_settle_is_counted_full_ones_apart():
    watch = gc_pauses.settle()
    assert set(gc_pauses.pauses()) == {"gc_pause_s_total", "gc_pause_max_s", "gc_full_collections"}
    n0, full0 = watch.count, watch.full
    garbage = [_Node() for _ in range(100)]
    del garbage
    gc.collect(0)
    gc.collect(2)
    assert watch.count == n0 + 2 and watch.full == full0 + 1
    after = gc_pauses.pauses()
    assert after["gc_full_collections"] == full0 + 1
    assert after["gc_pause_s_total"] >= after["gc_pause_max_s"] >= 0.0
    assert watch.total_s > 0.0  # two collections take some time


def test_the_heartbeat_carries_the_pauses_and_a_second_settle_keeps_one_watcher():
    assert not any(k.startswith("gc_") for k in Heartbeat().sample())
    first = gc_pauses.settle()
    second = gc_pauses.settle()
    assert first is second and gc.callbacks.count(first) == 1
    gc.collect()
    beat = Heartbeat().sample()
    assert beat["gc_full_collections"] >= 1.0 and "gc_pause_max_s" in beat
