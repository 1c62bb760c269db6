"""The whole local loop on a DENSE model (model=tiny_dense: grouped-query attention, tied
embeddings, no router), with the trainer split over two ranks by tensor parallelism. The same
path carries a pretrained Llama such as SmolLM2 (tests/integration/test_pretrained_smollm2.py)."""
from __future__ import annotations

import json

from tests.integration.conftest import SMALL, assert_no_children_left, metrics, slurmrl


def test_dense_model_trains_through_the_whole_loop_with_tp2(tmp_path):
    run_dir = tmp_path / "dense"
    slurmrl([*SMALL, "model=tiny_dense", "orchestrator.max_off_policy_steps=0", "trainer.num_steps=3",
             "trainer.num_ranks=2", "trainer.parallel.tp=2", f"launcher.run_dir={run_dir}"], tmp_path)
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert recs[0]["mismatch_kl"] < 1e-3, recs[0]["mismatch_kl"]  # engine and trainer: the same function
    assert all(r["aux_loss"] == 0.0 and not any(k.startswith("expert_load") for k in r) for r in recs)
    index = json.loads((run_dir / "weights" / "step_000003" / "index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in index and "model.layers.0.mlp.gate_proj.weight" in index
    assert not any(".experts." in n or n.endswith("mlp.gate.weight") for n in index)
    assert_no_children_left(run_dir)
