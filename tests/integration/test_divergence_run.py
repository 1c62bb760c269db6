"""A diverging local run, as the hostile test of issue 35 ran it (items 1 and 2): with
``trainer.lr=1e36 weights.skip_nonfinite=true`` the trainer used to train on NaN weights while
the orchestrator stalled silently for ``batch_timeout_s``, then the launcher restarted it twice
to the same end. Now every non-finite step is logged, the trainer stops with the reason after
``weights.max_nonfinite_skips``, and the launcher stops the run at once without a restart."""
from __future__ import annotations

import time

import pytest

from tests.integration.conftest import SMALL, assert_no_children_left, slurmrl
from workers.common.exits import EXIT_FATAL

pytestmark = pytest.mark.slow


def test_a_diverging_run_stops_at_once_with_the_reason(tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = slurmrl([*SMALL, "trainer.num_steps=10", "trainer.lr=1e36", "weights.skip_nonfinite=true",
                    "weights.max_nonfinite_skips=2", "launcher.max_restarts=2", "trainer.batch_timeout_s=120",
                    f"launcher.run_dir={run_dir}"], tmp_path, check=False, timeout=400)
    elapsed = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert f"trainer[0] exited with code {EXIT_FATAL}" in out and "not restarted" in out, out[-3000:]
    assert "the run diverges" in out, out[-3000:]  # the reason, from the trainer's log tail
    assert not (run_dir / "restarts.jsonl").exists()
    assert elapsed < 120, f"took {elapsed:.0f}s: a stall, not a stop"  # batch_timeout_s was 120
    log = (run_dir / "logs" / "trainer_0.log").read_text()
    assert log.count("holds NaN or inf after the optimizer step") == 2
    assert_no_children_left(run_dir)
