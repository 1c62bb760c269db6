"""fake_wandb: a stand-in for the ``wandb`` module for the failure paths the real package (the ``tracking``
extra; tests/unit/trainer/test_tracking_wandb.py) cannot be made to produce here, recording what the tracker asks.

It implements the part of wandb's API that workers/trainer/tracking.py calls — ``wandb.init(project=,
entity=, name=, id=, resume=, mode=, dir=, config=)`` returning a run with ``log(dict, step=)`` and
``finish()``, and ``wandb.Table(columns=, data=)`` (rows the length of the columns, as wandb checks) — with wandb's rule that a step lower than the last logged one is refused (wandb warns
and drops it), so the code under test is the real tracker code.
"""
from __future__ import annotations

from typing import Any, Optional

INIT_KEYS = {"project", "entity", "name", "id", "resume", "mode", "dir", "config"}


class FakeRun:
    def __init__(self, **kwargs: Any):
        self.init = kwargs
        self.logged: list[tuple[int, dict]] = []
        self.dropped: list[int] = []
        self.finished = False
        self.fail_next_log: Optional[Exception] = None

    def log(self, data: dict, step: Optional[int] = None) -> None:
        if self.fail_next_log is not None:
            e, self.fail_next_log = self.fail_next_log, None
            raise e
        if self.logged and step is not None and step < self.logged[-1][0]:
            self.dropped.append(step)
            return
        self.logged.append((step, dict(data)))

    def finish(self) -> None:
        self.finished = True


class FakeTable:
    def __init__(self, columns: Optional[list] = None, data: Optional[list] = None):
        assert columns and all(len(row) == len(columns) for row in data or []), (columns, data)
        self.columns, self.data = list(columns), [list(row) for row in data or []]


class FakeWandb:
    """Use as ``sys.modules["wandb"]``."""

    Table = FakeTable

    def __init__(self):
        self.runs: list[FakeRun] = []

    def init(self, **kwargs: Any) -> FakeRun:
        unknown = set(kwargs) - INIT_KEYS
        assert not unknown, f"wandb.init got arguments the fake does not know: {unknown}"
        assert kwargs.get("mode") in ("offline", "online", "disabled"), kwargs.get("mode")
        run = FakeRun(**kwargs)
        self.runs.append(run)
        return run
