"""The whole local loop on the DeepSeek-V3, GLM-5 and Nemotron-H architectures (their tiny presets):
the embedded engine generates with them (MLA latent cache, DSA indexer keys, Mamba-2 state), the
trainer trains them under the generic FSDP2 plan over two ranks with Router Replay over their
routed layers only, and publishes transformers directories the engine reloads every step."""
from __future__ import annotations

import json

import pytest

from tests.integration.conftest import SMALL, assert_no_children_left, metrics, slurmrl

FAMILIES = {  # preset -> (HF architecture, a routed layer's router weight, a tensor of another block kind)
    "deepseek_v3_tiny": ("DeepseekV3ForCausalLM", "model.layers.1.mlp.gate.weight",
                         "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"),
    "glm_moe_dsa_tiny": ("GlmMoeDsaForCausalLM", "model.layers.2.mlp.gate.e_score_correction_bias",
                         "model.layers.1.self_attn.indexer.wk.weight"),
    "nemotron_h_tiny": ("NemotronHForCausalLM", "backbone.layers.1.mixer.gate.weight",
                        "backbone.layers.0.mixer.A_log"),
}


@pytest.mark.parametrize("preset", sorted(FAMILIES))
def test_family_trains_through_the_whole_loop_under_fsdp(tmp_path, preset):
    arch, router, other = FAMILIES[preset]
    run_dir = tmp_path / preset
    slurmrl([*SMALL, f"model={preset}", "orchestrator.max_off_policy_steps=0", "trainer.num_steps=3",
             "trainer.num_ranks=2", "trainer.router_replay=true", "trainer.micro_batch_tokens=256",
             f"launcher.run_dir={run_dir}"], tmp_path)
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert recs[0]["mismatch_kl"] < 1e-3, recs[0]["mismatch_kl"]  # engine and trainer: the same function
    assert any(r["grad_norm"] > 0 for r in recs), recs  # it trains...
    # ...and a step whose rewards are all equal changes nothing (no balance loss by default, issue 32)
    assert all(r["grad_norm"] == 0 for r in recs if r["reward_std"] == 0), recs
    last = run_dir / "weights" / "step_000003"
    index = json.loads((last / "index.json").read_text())["weight_map"]
    assert router in index and other in index, sorted(index)[:8]
    assert json.loads((last / "config.json").read_text())["architectures"] == [arch]
    assert_no_children_left(run_dir)
