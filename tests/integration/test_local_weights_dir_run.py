"""A whole local run whose weight steps live outside the run directory (launcher.local_weights_dir,
the /dev/shm of a GPU node): trainer publishes, engines load and the orchestrator's retention
work through the run_dir/weights link, and the steps are back in the run directory at the end."""
from __future__ import annotations

import pytest

from tests.integration.conftest import SMALL, assert_no_children_left, metrics, slurmrl


@pytest.mark.slow
def test_steps_go_through_the_linked_dir_and_come_back(tmp_path):
    run_dir, fast = tmp_path / "linked", tmp_path / "fast"
    out = slurmrl([*SMALL, "trainer.num_steps=3", f"launcher.run_dir={run_dir}", f"launcher.local_weights_dir={fast}"],
                  tmp_path)
    assert f"weights: published steps in {fast / 'linked' / 'weights'}" in out.stdout
    assert "GPUs: " in out.stdout  # the placement line (none on a CPU machine)
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert max(r["policy_version"] for r in recs) >= 2  # the engines loaded published steps
    weights = run_dir / "weights"
    assert not weights.is_symlink() and (weights / "step_000003" / "STABLE").exists()
    assert not (fast / "linked").exists()
    assert_no_children_left(run_dir)
