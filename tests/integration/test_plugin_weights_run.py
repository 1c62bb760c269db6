"""The whole loop with the test-only transport ``fake_copy`` (tests/plugins/weights_plugin.py),
selected purely by ``SLURMRL_PLUGINS`` and ``weights=fake_copy``: the real ``slurmrl`` CLI,
a trainer and 2 embedded workers. After step 0 no filesystem step is written; every update
goes through the plugin's copies, and both workers end bit-identical to each copy applied."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SMALL = ["orchestrator.num_prompts_per_step=4", "orchestrator.num_samples_per_prompt=4",
         "orchestrator.max_inflight_rollouts=32"]


def test_plugin_transport_runs_the_loop(tmp_path):
    run_dir = tmp_path / "copy"
    cmd = [sys.executable, "-m", "launcher", f"cluster.runs_root={tmp_path / 'runs'}", "weights=fake_copy",
           "trainer.num_steps=5", "orchestrator.max_off_policy_steps=1", *SMALL, f"launcher.run_dir={run_dir}"]
    env = dict(os.environ, SLURMRL_PLUGINS="tests.plugins.weights_plugin")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "finished: 5 steps" in proc.stdout
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["step_000000"]  # only step 0 on the filesystem
    applied = [json.loads(p.read_text()) for p in sorted((run_dir / "weights_copy").glob("v_*/APPLIED.json"))]
    assert applied and all(a["ok"] and len(a["digests"]) == 2 for a in applied), applied
    last = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()][-1]
    assert last["weight_updates_verified"] >= 2 and last["weight_updates_mismatched"] == 0, last
