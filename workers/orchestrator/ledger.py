"""Rollout ledger: every prompt group the orchestrator starts, and where it ended up.

Why: inference workers die, the orchestrator itself dies, and the trainer rewinds to a
checkpoint. Through all of that each rollout group (id ``g<group_id>``, samples
``g<group_id>-s<i>``) must be trained at most once and lost never. The ledger is the
record that makes both checkable and makes a restarted orchestrator resume exactly:

- ``launch``   group g (task_id t) was sent to worker w,
- ``resubmit`` its worker died or failed; g is sent again elsewhere (same g and t),
- ``batch``    step N's batch holds groups [...] (appended right after READY is published),
- ``drop``     groups went stale in the buffer (by design of bounded off-policy RL),
- ``abandon``  the run ended with these still in flight (nothing left to train them).

A group is *pending* when it was launched and has none of batch/drop/abandon; a restarted
orchestrator re-runs exactly the pending groups (same ids, same tasks: the env's task
stream is replayed by ``groups_started``). A group is *lost* when a finished run left it
pending, and *trained twice* when two batches hold it.

Format: append-only JSON lines in ``run_dir/orchestrator_ledger.jsonl``, one event per
line, flushed per line (an orchestrator crash is a process death: the page cache keeps the
lines). A torn last line (killed mid-write) is ignored. The one crash window, between a
batch's READY rename and its ``batch`` line, is closed by :meth:`Ledger.recover_batches`,
which reads group ids back from ``rollouts/step_N/meta.json``.
"""
from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Optional

from workers.common.protocol import READY, ROLLOUTS_DIR


class Ledger:
    """In-memory view of the ledger file plus an appender. One writer: the orchestrator."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.launched: dict[int, int] = {}  # group id -> task id
        self.worker: dict[int, int] = {}  # group id -> worker it runs (ran) on
        self.resubmits: dict[int, int] = defaultdict(int)
        self.trained: dict[int, list[int]] = defaultdict(list)  # group id -> batch steps holding it
        self.batches: dict[int, list[int]] = {}  # step -> group ids
        self.dropped: set[int] = set()
        self.abandoned: set[int] = set()
        self.num_restarts = 0  # orchestrator incarnations after the first
        if self.path.exists():
            self._replay()
        self._fh = open(self.path, "a", encoding="utf-8")
        if self.launched or self.batches:
            self.num_restarts += 1
            self._append({"ev": "restart", "pending": len(self.pending())})

    # ---- reading -----------------------------------------------------------------------
    def _replay(self) -> None:
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                e = json.loads(line)
            except ValueError:  # torn last line of a killed writer
                continue
            self._apply(e)

    def _apply(self, e: dict) -> None:
        ev = e.get("ev")
        if ev == "launch":
            self.launched[e["gid"]] = e["task_id"]
            self.worker[e["gid"]] = e["worker"]
        elif ev == "resubmit":
            self.resubmits[e["gid"]] += 1
            self.worker[e["gid"]] = e["worker"]
        elif ev == "batch":
            self.batches[e["step"]] = list(e["gids"])
            for g in e["gids"]:
                self.trained[g].append(e["step"])
        elif ev == "drop":
            self.dropped.update(e["gids"])
        elif ev == "abandon":
            self.abandoned.update(e["gids"])
        elif ev == "restart":
            self.num_restarts += 1

    def _append(self, e: dict) -> None:
        e["t"] = round(time.time(), 3)
        self._fh.write(json.dumps(e, separators=(",", ":")) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()

    # ---- events ------------------------------------------------------------------------
    def launch(self, gid: int, task_id: int, worker: int) -> None:
        assert gid not in self.launched, f"group {gid} launched twice: use resubmit"
        e = {"ev": "launch", "gid": gid, "task_id": task_id, "worker": worker}
        self._apply(e)
        self._append(e)

    def resubmit(self, gid: int, worker: int, reason: str) -> None:
        e = {"ev": "resubmit", "gid": gid, "worker": worker, "reason": reason[:300]}
        self._apply(e)
        self._append(e)

    def batch(self, step: int, gids: Iterable[int]) -> None:
        gids = list(gids)
        twice = [g for g in gids if self.trained.get(g)]
        assert step not in self.batches, f"batch for step {step} written twice"
        assert not twice, f"groups {twice} are already in batches {[self.trained[g] for g in twice]}"
        e = {"ev": "batch", "step": step, "gids": gids}
        self._apply(e)
        self._append(e)

    def drop(self, gids: Iterable[int]) -> None:
        gids = sorted(gids)
        if gids:
            e = {"ev": "drop", "gids": gids}
            self._apply(e)
            self._append(e)

    def abandon(self, gids: Iterable[int]) -> None:
        gids = sorted(gids)
        if gids:
            e = {"ev": "abandon", "gids": gids}
            self._apply(e)
            self._append(e)

    def note(self, ev: str, **fields) -> None:
        """A free-form event (worker_dead, worker_back, ...): ignored by the state, kept for benchmarks."""
        self._append({"ev": ev, **fields})

    # ---- derived state -----------------------------------------------------------------
    @property
    def next_step(self) -> int:
        """The step whose batch comes next (steps are 1-based: the first batch is step 1's)."""
        return max(self.batches) + 1 if self.batches else 1

    @property
    def groups_started(self) -> int:
        """Distinct groups ever started = tasks drawn from the env's stream (ids are 0..n-1)."""
        return max(self.launched) + 1 if self.launched else 0

    def pending(self) -> list[int]:
        done = set(self.trained) | self.dropped | self.abandoned
        return sorted(g for g in self.launched if g not in done)

    def recover_batches(self, run_dir: Path) -> list[int]:
        """Record batches whose READY exists but whose ``batch`` line was never appended."""
        root = Path(run_dir) / ROLLOUTS_DIR
        found = []
        if not root.is_dir():
            return found
        for d in sorted(root.iterdir()):
            if not (d.name.startswith("step_") and (d / READY).exists()):
                continue
            step = int(d.name[5:])
            if step in self.batches:
                continue
            meta = json.loads((d / "meta.json").read_text())
            self.batch(step, [s["group_id"] for s in meta["samples"]])
            found.append(step)
        return found

    def summary(self) -> dict:
        """Counts for tests and the chaos benchmark (a finished run must show 0 lost, 0 twice)."""
        return {
            "groups_launched": len(self.launched),
            "groups_trained": sum(1 for v in self.trained.values() if v),
            "groups_trained_twice": sum(1 for v in self.trained.values() if len(v) > 1),
            "groups_dropped_stale": len(self.dropped - set(self.trained)),
            "groups_abandoned_at_end": len(self.abandoned),
            "groups_pending": len(self.pending()),
            "groups_resubmitted": len(self.resubmits),
            "num_resubmits": sum(self.resubmits.values()),
            "orchestrator_restarts": self.num_restarts,
        }


def read_ledger(path: Path) -> Ledger:
    """Open a ledger read-only (benchmarks, tests): replay without appending anything."""
    led = Ledger.__new__(Ledger)
    led.path = Path(path)
    led.launched, led.worker, led.resubmits = {}, {}, defaultdict(int)
    led.trained, led.batches, led.dropped, led.abandoned = defaultdict(list), {}, set(), set()
    led.num_restarts = 0
    if led.path.exists():
        led._replay()
    led._fh = open(os.devnull, "a")
    return led


def lost_groups(led: Ledger, finished: bool) -> Optional[int]:
    """Pending groups of a finished run are lost (None while the run still goes on)."""
    return len(led.pending()) if finished else None
