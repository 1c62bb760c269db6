"""A refused step is replaced by a full one at once (``weights.delta``): the orchestrator asks, the trainer writes.

Why: with patch steps every version after an anchor needs the ones before it. One damaged patch (a
flipped byte, a truncated or deleted file, a garbage index, a wrong base) made every later patch
unloadable too; the workers stayed on the last good version, the trainer ran ``max_off_policy_steps + 1``
ahead, waited ``trainer.batch_timeout_s`` and stopped, and a restarted trainer republished the same
version numbers, which the orchestrator had marked as refused for good.

Protocol (files under ``run_dir/weights``; torch-free, the orchestrator imports it):
  O  before trying version V it notes V's STABLE marker (inode, mtime); when every failing worker
     refused V for its content, V joins RetryPolicy.refused and, unless V was written again meanwhile,
     it writes ``REANCHOR`` = {"seq": n + 1, "version": V, "patch": V was a patch step, "why": ...}
     (atomically). A refused V whose STABLE marker changed since (the step was written again: an
     anchor out of turn, or a restarted trainer) is tried again.
  T  while waiting for its next batch (PatchPublisher.wait, in lockstep on every rank) a request
     with a new ``seq`` for a version of the current chain (after the last anchor, or the anchor
     itself when the refused step was a full one) makes it publish its newest version again as a
     full step (an anchor out of turn; the model has not moved since). A patch refused because an
     earlier one was damaged asks again for the same chain: the one anchor answers both.
Nothing waits on the file: a lost request costs what it cost before (the next cadence anchor).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from workers.common.protocol import STABLE, step_name, write_json_atomic
from workers.weights.delta import FORMAT as PATCH_FORMAT
from workers.weights.filesystem.layout import INDEX

REQUEST = "REANCHOR"


def stable_mark(weights_root: Path, version: int) -> Optional[tuple[int, int]]:
    """Identity of step V's STABLE marker (a new one each time the step is written), None if absent."""
    try:
        st = os.lstat(Path(weights_root) / step_name(version) / STABLE)
    except (OSError, ValueError):
        return None
    return st.st_ino, st.st_mtime_ns


def read_request(weights_root: Path) -> tuple[int, int, bool]:
    """The trainer side: (seq, version, patch) of the newest request, (0, -1, True) when there is none
    or it is unreadable."""
    try:
        req = json.loads((Path(weights_root) / REQUEST).read_text())
        seq, version, patch = req["seq"], req["version"], req.get("patch", True)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0, -1, True
    return (seq, version, bool(patch)) if type(seq) is int and type(version) is int else (0, -1, True)


def is_patch_step(step_dir: Path) -> bool:
    """Whether a step's index.json says it is a patch step (unreadable: False, it may be the anchor)."""
    try:
        return json.loads((Path(step_dir) / INDEX).read_text()).get("format") == PATCH_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


class Reanchor:
    """The orchestrator's side (module docstring): one per coordinator."""

    def __init__(self, weights_root: Path, retry: Any, *, enabled: bool, log: Any):
        self.root, self.retry, self.enabled, self.log = Path(weights_root), retry, enabled, log
        self.marks: dict[int, Optional[tuple[int, int]]] = {}  # version -> its STABLE when last tried
        self.seq = read_request(self.root)[0]  # a restarted orchestrator goes on counting
        self.requested = 0  # requests written by this process (metrics)

    def trying(self, version: int) -> None:
        """Note V's marker before a try: a step rewritten while it was being refused is tried again."""
        self.marks[version] = stable_mark(self.root, version)

    def forget_rewritten(self) -> None:
        """Refused versions whose step was written again since are tried again."""
        for v in sorted(self.retry.refused):
            if v in self.marks and stable_mark(self.root, v) not in (None, self.marks[v]):
                self.retry.refused.discard(v)
                self.log.info("weights v%d was written again: trying it again", v)

    def refused(self, version: int, why: str) -> None:
        """V was refused for its content: ask the trainer for a full step of its newest version."""
        if not self.enabled or stable_mark(self.root, version) != self.marks.get(version):
            return  # written again while it was being refused: tried again next turn
        self.seq += 1
        self.requested += 1
        write_json_atomic(self.root / REQUEST, {"seq": self.seq, "version": version, "why": why[:500],
                                                "patch": is_patch_step(self.root / step_name(version))})
        self.log.warning("weights v%d refused for its content: asked the trainer for a full step (%s, seq %d)",
                         version, REQUEST, self.seq)
