"""A device fault in the embedded engine, for the crash-handling tests (issue 22).

A real engine crashes on a CUDA error, an out-of-memory or a kernel bug; none of those can be
caused on purpose on a CPU with weights alone (weights whose logits overflow no longer crash
the engine: those rows are drawn uniformly so a diverged trainer's run stops with its own
reason). So the tests make the engine's forward raise once weights of a chosen version are
live, the way such a fault surfaces: a RuntimeError inside the engine loop.

``python -m tests.helpers.engine_fault VERSION`` runs the real inference server
(``python -m workers.inference``) with the fault armed, for tests that need a process.
"""
from __future__ import annotations

import runpy
import sys

from workers.inference.embedded.static_engine import StaticEngine
from workers.inference.embedded.engine import InferenceEngine

FAULT = "injected device fault (test): the forward failed"


def arm(at_version: int, monkeypatch=None) -> None:
    """Every engine's prefill and decode (the dynamic engine's and the static engine's, which
    overrides both) raise RuntimeError once its weight version is >= ``at_version`` (through
    pytest's ``monkeypatch`` when given, so an in-process test leaves the classes as they were)."""
    targets = [(InferenceEngine, "_prefill"), (InferenceEngine, "_decode"),
               (StaticEngine, "_prefill"), (StaticEngine, "_decode_block")]

    def faulty(real):
        def step(self, *args):
            if self.weight_version >= at_version:
                raise RuntimeError(FAULT)
            return real(self, *args)
        return step

    for cls, name in targets:
        patched = faulty(vars(cls)[name])
        if monkeypatch is not None:
            monkeypatch.setattr(cls, name, patched)
        else:
            setattr(cls, name, patched)


if __name__ == "__main__":
    arm(int(sys.argv[1]))
    sys.argv = [sys.argv[0]]
    runpy.run_module("workers.inference", run_name="__main__", alter_sys=True)
