"""A real local run in LoRA mode (issue 44 item 3): launcher -> trainer + 2 embedded workers + orchestrator.

Step 0 is the frozen base (a full step), every later step the trainer's adapter (PEFT files + the
digest side file); the workers load each version onto the unchanged base without merging and confirm
it by the digest of their buffers. Checked: the served adapter changes version by version (each
worker's logged digest per version equals the trainer's, all distinct), every batch was sampled by
the version it trains on (synchronous), the engine's log-probs equal the trainer's LoRA forward
(mismatch_kl ~ 0, which only holds if base + adapter on the engine equals the trainer's model), the
update is the adapter's bytes, and nothing was unconfirmed.
"""
from __future__ import annotations

import json
import re

from tests.integration.conftest import SMALL, assert_no_children_left, metrics, slurmrl


def test_lora_run_serves_each_adapter_version_confirmed(tmp_path):
    run_dir = tmp_path / "lora"
    slurmrl([*SMALL, "orchestrator.max_off_policy_steps=0", "trainer.num_steps=3", "trainer.lora.rank=4",
             "trainer.lora.alpha=8", "trainer.lr=1e-2", "weights.keep_last=5", f"launcher.run_dir={run_dir}"], tmp_path)
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert r["policy_version_min"] == r["policy_version_max"] == r["step"] - 1, r
        assert r["mismatch_kl"] < 1e-6, r["mismatch_kl"]
        assert r["weight_updates_unconfirmed"] == 0 and r["samples_dropped_unconfirmed_total"] == 0
    weights = run_dir / "weights"
    assert (weights / "step_000000" / "model.safetensors").is_file()  # the base, kept
    trainer = {v: json.loads((weights / f"step_{v:06d}" / "slurmrl_adapter.json").read_text()) for v in (1, 2)}
    assert all(t["bytes"] == recs[0]["weight_bytes"] for t in trainer.values())  # the update is the adapter
    full = (weights / "step_000000" / "model.safetensors").stat().st_size
    assert recs[0]["weight_bytes"] < full / 10
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("inference*.log"))
    served = re.findall(r"loaded adapter v(\d+) .* digest ([0-9a-f]{16})", logs)
    by_version = {}
    for v, d in served:
        by_version.setdefault(int(v), set()).add(d)
    assert {v: by_version.get(v) for v in (1, 2)} == {v: {trainer[v]["digest"]} for v in (1, 2)}, served
    assert trainer[1]["digest"] != trainer[2]["digest"]
    assert len([v for v, _ in served if v == "1"]) == 2  # both workers
    assert_no_children_left(run_dir)
