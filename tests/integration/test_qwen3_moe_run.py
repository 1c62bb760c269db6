"""The whole local loop on qwen3_moe (model=qwen3_moe_tiny): the embedded engine generates with
Qwen3-MoE (q/k norms, head_dim 24 on hidden 64, GQA, one dense layer among three), the trainer
trains it with Router Replay over its two routed layers, tensor parallel over two ranks (the
per-head q/k norms inside the TP region), and publishes HF-named weights the engine reloads."""
from __future__ import annotations

import json

from tests.integration.conftest import SMALL, assert_no_children_left, metrics, slurmrl


def test_qwen3_moe_tiny_trains_through_the_whole_loop_with_tp2(tmp_path):
    run_dir = tmp_path / "qwen3"
    slurmrl([*SMALL, "model=qwen3_moe_tiny", "orchestrator.max_off_policy_steps=0", "trainer.num_steps=3",
             "trainer.num_ranks=2", "trainer.parallel.tp=2", "trainer.router_replay=true",
             f"launcher.run_dir={run_dir}"], tmp_path)
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert recs[0]["mismatch_kl"] < 1e-3, recs[0]["mismatch_kl"]  # engine and trainer: the same function
    assert all(r["aux_loss"] > 0.0 for r in recs)
    # load per ROUTED layer: two of them (records index routed layers, not layer numbers)
    assert all("expert_load_max_l1" in r and "expert_load_max_l2" not in r for r in recs)
    print(f"\nqwen3_moe_tiny run: mismatch_kl per step {[r['mismatch_kl'] for r in recs]}")
    index = json.loads((run_dir / "weights" / "step_000003" / "index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.gate_proj.weight" in index and "model.layers.0.mlp.gate.weight" not in index  # dense
    assert {"model.layers.1.mlp.gate.weight", "model.layers.2.mlp.experts.7.down_proj.weight",
            "model.layers.2.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"} <= set(index)
    assert_no_children_left(run_dir)
