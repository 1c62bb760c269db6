"""The whole loop with ``weights=broadcast``: the real ``slurmrl`` CLI, 2 trainer ranks (two
senders, one per DP shard) and 2 embedded inference workers on gloo. Every update the
orchestrator requested must be applied by both workers bit for bit (``weights.verify``: the
digest each worker reports equals the trainer's), and the run must finish cleanly.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SMALL = ["orchestrator.num_prompts_per_step=4", "orchestrator.num_samples_per_prompt=4",
         "orchestrator.max_inflight_rollouts=32"]


def test_broadcast_run_with_two_senders_and_two_workers_is_bit_exact(tmp_path):
    run_dir = tmp_path / "bcast"
    cmd = [sys.executable, "-m", "launcher", f"cluster.runs_root={tmp_path / 'runs'}", "weights=broadcast",
           "trainer.num_ranks=2", "trainer.num_steps=6", "orchestrator.max_off_policy_steps=1", *SMALL,
           f"launcher.run_dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "finished: 6 steps" in proc.stdout
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in recs] == list(range(1, 7))
    sent = [r for r in recs if not r["weight_sync_skipped"]]
    assert sent and all(r["weight_bytes"] > 0 and r["weight_sync_s"] > 0 and r["weight_sync_gbps"] > 0 for r in sent)
    last = recs[-1]
    # Each update the orchestrator applied before writing the last batch was checked on both workers.
    assert last["weight_updates_verified"] >= 2 and last["weight_updates_mismatched"] == 0, last
    assert last["orchestrator_weight_version"] == last["weight_updates_verified"]
    group = json.loads((run_dir / "weights" / "broadcast" / "group.json").read_text())
    assert (group["world_size"], group["num_senders"], group["backend"]) == (4, 2, "gloo")
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["broadcast", "step_000000"]  # no disk after 0
    for rank in (0, 1):
        log = (run_dir / "logs" / f"inference_{rank}.log").read_text()
        assert f"as rank {2 + rank} of 4" in log and "received v1" in log and "refused" not in log
