"""The whole loop with sparse weight patches (weights.delta, issue 31): trainer at world 2 (FSDP),
bf16 published over fp32 master weights, two embedded workers, the orchestrator verifying every
update end to end (each worker's sum64 digest after applying against the step's index.json)."""
from __future__ import annotations

import json

import pytest
from tests.integration.conftest import SMALL, assert_no_children_left, metrics, slurmrl

pytestmark = pytest.mark.slow


def test_patch_run_verifies_every_update_and_reports_what_it_sent(tmp_path):
    run_dir = tmp_path / "delta"
    slurmrl([*SMALL, "weights.delta=true", "weights.delta_full_every=3", "weights.verify=true", "trainer.num_steps=7",
             "trainer.num_ranks=2", "trainer.dtype=bfloat16", "inference.dtype=bfloat16", "trainer.lr=1e-4",
             f"launcher.run_dir={run_dir}"], tmp_path)
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == list(range(1, 8))
    patches = [r for r in recs if r["weight_anchor"] == 0]
    assert patches and all(0 < r["weight_changed_frac"] < 1 and r["weight_blocked_s"] >= 0 for r in patches)
    assert [r["weight_anchor"] for r in recs] == [0, 0, 1, 0, 0, 1, 0]  # anchors: versions 0, 3, 6
    done = [r for r in recs if "weight_published_version" in r]
    assert done and all(r["weight_published_bytes"] <= r["weight_published_dense_bytes"] * 1.1 for r in done)
    assert max(r.get("weight_updates_mismatched", 0) for r in recs) == 0
    assert max(r.get("weight_updates_verified", 0) for r in recs) >= 3, [r.get("weight_updates_verified") for r in recs]
    newest = json.loads((run_dir / "weights" / "step_000007" / "index.json").read_text())
    assert newest["format"] == "slurmrl-delta/1" and newest["base"] == 6 and newest["anchor"] == 6
    assert_no_children_left(run_dir)
