"""Issue 47 item 1: one damaged patch step never stops a run. A real local run with sparse patches
(``delta_full_every=10``, ``max_off_policy_steps=2``) whose trainer damages five patch steps before they
appear (tests/plugins/damaged_weights_plugin.py: a flipped byte, a truncated and a deleted patch file, a
garbage index.json, a wrong base): each is refused by the workers, the orchestrator asks for a full step
(workers/weights/filesystem/reanchor.py), the trainer writes one at once, and the run goes on. Nothing is
lost: every step once in metrics.jsonl, no trainer restart, the trainer never waited long for a batch,
and the workers end on the last version, verified."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.configs import REPO
from tests.integration.conftest import SMALL, assert_no_children_left, metrics

pytestmark = pytest.mark.slow

NUM_STEPS = 16
KINDS = ["base", "flip", "truncate", "delete", "index"]  # base first: it needs a patch two versions after an anchor


def test_each_kind_of_damaged_patch_is_replaced_by_an_anchor_and_the_run_goes_on(tmp_path):
    run_dir = tmp_path / "damaged"
    cmd = [sys.executable, "-m", "launcher", f"cluster.runs_root={tmp_path / 'runs'}", *SMALL,
           "weights=damaged_patches", f"weights.damage='{','.join(KINDS)}'", "weights.damage_gap=2", "weights.verify=true", f"trainer.num_steps={NUM_STEPS}",
           "trainer.dtype=bfloat16", "inference.dtype=bfloat16", "trainer.lr=1e-4", "trainer.batch_timeout_s=90",
           "orchestrator.max_off_policy_steps=2", f"launcher.run_dir={run_dir}"]
    env = dict(os.environ, SLURMRL_PLUGINS="tests.plugins.damaged_weights_plugin")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    damaged = [json.loads(x) for x in (run_dir / "weights_damaged.jsonl").read_text().splitlines()]
    assert [d["kind"] for d in damaged] == KINDS, damaged
    # batch N needs weights of version >= N - 1 - max_off_policy_steps: the run had to get past every damage
    assert damaged[-1]["version"] <= NUM_STEPS - 4, damaged
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == list(range(1, NUM_STEPS + 1))  # every step once
    assert max(r["idle_s"] for r in recs) < 30, [round(r["idle_s"], 1) for r in recs]  # never near the timeout
    last = recs[-1]
    assert last["weight_reanchors_total"] >= len(damaged), last  # one anchor out of turn per damaged step at least
    assert last["weight_updates_refused"] >= len(damaged) and last["weight_updates_mismatched"] == 0, last
    assert last["weight_updates_verified"] >= 3, last  # the anchors out of turn and the patches after them
    assert not (run_dir / "checkpoints" / "resumes.jsonl").exists()  # the trainer never restarted
    orch = (run_dir / "logs" / "orchestrator_0.log").read_text()
    assert "Traceback" not in (run_dir / "logs" / "trainer_0.log").read_text()
    assert orch.count("asked the trainer for a full step") >= len(damaged)
    for d in damaged:  # each damaged version was refused (itself, or a patch on top of it), then written again
        assert any(f"weights v{v} refused for its content" in orch for v in range(d["version"], d["version"] + 3)), d
    assert_no_children_left(run_dir)
