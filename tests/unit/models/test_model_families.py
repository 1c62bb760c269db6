"""Model families behind the registry (workers/models): per-family schemas refuse fields the family
does not use, plan-only families plan but never start, and every family answers the generic facts.

The plan's numbers for the big presets are pinned here (they feed launcher/estimate.py and the
simulator, tools/simulator); the buildable families' counted parameters equal their torch modules'.
"""
from __future__ import annotations

import pytest
import torch

from launcher.estimate import count_params
from launcher.plan import PlanError, build_plan
from tests.conftest import compose
from tests.unit.conftest import slurmrl
from workers.common.registry import MODELS
from workers.models.facts import architecture
from workers.models.spec import MESH_PLAN

PRESETS = {  # preset -> (family, total, active, mtp): the plan's counts before the families had homes
    "tiny_moe": ("tiny_moe", 3_417_216, 1_057_920, 0),
    "tiny_dense": ("llama", 593_024, 593_024, 0),
    "smollm2_135m": ("llama", 134_515_008, 134_515_008, 0),
    "gpu_moe_1b5": ("tiny_moe", 1_476_954_112, 419_989_504, 0),
    # glm5: +256 a layer since the count includes the DSA indexer's k_norm LayerNorm (weight and bias)
    "glm5": ("glm_moe_dsa", 743_911_199_232, 41_784_709_632, 9_952_914_176),
    "kimi_k2": ("deepseek_v3", 1_026_408_209_408, 32_861_477_888, 0),
    "nemotron3_ultra": ("nemotron_h", 549_308_968_960, 56_058_818_560, 0),  # real hybrid counts (was MHA+MoE)
    "qwen3_moe_tiny": ("qwen3_moe", 280_144, 132_688, 0),
    "qwen3_30b_a3b": ("qwen3_moe", 30_532_122_624, 3_353_032_704, 0),  # published: 30.5B total, 3.3B activated
    "gemma3_1b": ("gemma3_text", 999_885_952, 999_885_952, 0),
    "gpt_oss_20b": ("gpt_oss", 20_914_757_184, 4_187_440_704, 0),  # published 3.6B active excludes the embedding
}
# nemotron: its 12 attention layers only (the Mamba state is per sequence, not per token)
KV_KIB_BF16 = {"glm5": 87.75, "kimi_k2": 68.625, "nemotron3_ultra": 12.0, "qwen3_30b_a3b": 96.0,
               "gemma3_1b": 26.0, "gpt_oss_20b": 48.0}  # sliding-window layers counted whole (the cache keeps all)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_facts_are_unchanged(preset):
    family, total, active, mtp = PRESETS[preset]
    m = compose([f"model={preset}"]).model
    assert m.family == family and type(m) is MODELS.get(family).config
    p = count_params(m)  # what build_plan reports and sizes the memory estimates with
    assert (p.total, p.active, p.mtp) == (total, active, mtp)
    if preset in KV_KIB_BF16:
        assert MODELS.get(family).kv_bytes_per_token(m, 2) / 1024 == KV_KIB_BF16[preset]


@pytest.mark.parametrize("family", ["tiny_moe", "llama", "deepseek_v3", "glm_moe_dsa", "nemotron_h", "qwen3_moe",
                                    "qwen3", "qwen2", "mistral", "gemma3_text", "gpt_oss"])
def test_every_family_answers_the_generic_facts(family):
    spec = MODELS.get(family)
    assert spec.name == family and spec.config().family == family
    assert spec.buildable  # every family builds now (the trainer plans differ: test below)
    dense = family in ("llama", "qwen3", "qwen2", "mistral", "gemma3_text")
    m = spec.config()
    assert (m.num_experts == 0) == dense and (m.top_k == 0) == dense  # fields of MoE schemas, 0 from the base
    assert (spec.router_hook is None) == dense
    assert architecture(m).is_moe != dense


@pytest.mark.parametrize("preset", ["tiny_moe", "tiny_dense", "qwen3_moe_tiny", "qwen3_30b_a3b", "qwen3_tiny",
                                    "qwen2_tiny", "mistral_tiny", "gemma3_1b", "gpt_oss_20b"])
def test_buildable_families_build_on_meta_and_count_what_they_build(preset):
    m = compose([f"model={preset}"]).model
    spec = MODELS.get(m.family)
    model = spec.build(m, device="meta", dtype="bfloat16")
    params = list(model.parameters())
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in params)
    assert sum(p.numel() for p in params) == spec.params(m).total
    assert spec.to_hf(model.state_dict()).keys() == model.state_dict().keys()  # HF names natively


@pytest.mark.parametrize("experiment", ["glm5_swe_28xh200", "kimi_k2_swe_32xh200", "nemotron3_ultra_pd_20xh200"])
def test_tp_ep_layouts_of_the_large_presets_plan_onto_the_mesh_plan(experiment):
    """deepseek_v3, glm_moe_dsa, nemotron_h presets' expert-parallel layouts plan for a real run onto
    the mesh plan (workers/trainer/parallel/mesh.py), with no refusal and no dry-run WARNING, at 8k-token
    episodes. At their 131k limit Kimi K2 (cp 8), Nemotron 3 Ultra and GLM-5 (cp 16: its DSA indexer
    in bounded chunks) plan too, context parallel inside the mesh plan, and are refused without
    their cp (the planner names the cp that fits)."""
    short = ["env.max_episode_tokens=8192", "env.max_new_tokens_per_turn=2048", "trainer.micro_batch_tokens=8192"]
    for dry in ("false", "true"):
        plan = build_plan(compose([f"experiment={experiment}", "cluster=h200_ib", f"launcher.dry_run={dry}", *short]))
        assert plan.trainer_dims.ep > 1 and plan.trainer_dims.plan == MESH_PLAN
        assert not any("refused" in w for w in plan.trainer_dims.warnings), plan.trainer_dims.warnings
    real = [f"experiment={experiment}", "cluster=h200_ib", "launcher.dry_run=false"]
    plan = build_plan(compose(real))
    cp = plan.trainer_dims.cp
    assert cp > 1 and plan.trainer_dims.plan == MESH_PLAN and not plan.trainer_dims.warnings
    (mem,) = [m for m in plan.memory if m.what == "trainer"]
    assert mem.fits and f"{131072 // cp} tokens/GPU (131072 per forward / cp {cp})" in mem.detail
    with pytest.raises(PlanError, match=rf"does not fit its GPUs.*use trainer\.parallel\.cp >= {cp} \(context parallel\)"):
        build_plan(compose([*real, "trainer.parallel.cp=1", f"trainer.parallel.dp={plan.trainer_dims.dp * cp}"]))


@pytest.mark.parametrize("args, key, schema", [
    (["model=tiny_moe", "model.q_lora_rank=8"], "q_lora_rank", "TinyMoeConfig"),
    (["model=tiny_dense", "model.num_experts=8"], "num_experts", "LlamaConfig"),
    (["model=smollm2_135m", "model.top_k=2"], "top_k", "LlamaConfig"),
    (["model=glm5", "model.num_kv_heads=8"], "num_kv_heads", "GlmMoeDsaConfig"),
])
def test_a_field_the_family_does_not_use_is_refused_by_the_cli(args, key, schema, tmp_path):
    res = slurmrl([*args, "launcher.dry_run=true"], tmp_path)
    assert res.returncode == 2, res.stderr
    assert f"model.{key}" in res.stderr and schema in res.stderr
    assert not (tmp_path / "runs").exists()


def test_changing_the_family_refuses_the_old_family_fields(tmp_path):
    res = slurmrl(["model=tiny_moe", "model.family=llama", "launcher.dry_run=true"], tmp_path)
    assert res.returncode == 2 and "model.num_experts is not used by model family 'llama'" in res.stderr


def test_family_checks_name_the_key():
    with pytest.raises(PlanError, match="trainer.router_replay=true needs a MoE model"):
        build_plan(compose(["model=tiny_dense", "trainer.router_replay=true"]))
    with pytest.raises(PlanError, match="model.pretrained=smollm2_135m is a llama checkpoint"):
        build_plan(compose(["model.pretrained=smollm2_135m"]))
    with pytest.raises(PlanError, match=r"model.num_dense_layers\(61\)"):
        build_plan(compose(["experiment=kimi_k2_swe_32xh200", "cluster=h200_ib", "model.num_dense_layers=61"]))


def test_a_plan_built_from_python_refuses_a_section_of_another_family():
    """build_plan itself (not only the CLI) refuses fields the named family does not have."""
    import dataclasses

    from workers.models.deepseek_v3.spec import DeepseekV3Config

    cfg = compose([])
    shared = {f.name for f in dataclasses.fields(DeepseekV3Config)}
    mla = DeepseekV3Config(**{k: v for k, v in dataclasses.asdict(cfg.model).items() if k in shared and k != "family"},
                           family="tiny_moe", q_lora_rank=8)
    with pytest.raises(PlanError, match=r"model\.\w+ is not used by model family 'tiny_moe'"):
        build_plan(dataclasses.replace(cfg, model=mla))


def test_a_qwen3_moe_tiny_run_plans_to_start():
    """model=qwen3_moe_tiny composes into a run the plan accepts as startable (not a dry run),
    with routing records over its two MoE layers (layer 0 is dense: mlp_only_layers=[0])."""
    cfg = compose(["model=qwen3_moe_tiny", "launcher.dry_run=false"])
    m = cfg.model
    assert (m.family, m.head_dim, m.mlp_only_layers, m.num_routed_layers) == ("qwen3_moe", 24, [0], 2)
    assert build_plan(cfg).num_params == 280_144


@pytest.mark.parametrize("override, message", [
    ("model.num_kv_heads=3", r"model.num_kv_heads\(3\) must divide model.num_heads\(4\)"),
    ("model.top_k=9", r"model.top_k\(9\) must be <= model.num_experts\(8\)"),
    ("model.mlp_only_layers=[0,3]", r"model.mlp_only_layers has \[3\]: layer indices must be in \[0, model.num_layers\(3\)\)"),
    ("model.mlp_only_layers=[1,1]", r"lists a layer twice"),
    ("model.decoder_sparse_step=4", r"leave no MoE layer among model.num_layers\(3\)"),
    ("model.dense_intermediate_size=0", r"model.dense_intermediate_size must be > 0"),
    ("model.head_dim=7", r"model.head_dim\(7\) must be even"),
])
def test_qwen3_moe_plan_checks_name_the_key_and_numbers(override, message):
    with pytest.raises(PlanError, match=message):
        build_plan(compose(["model=qwen3_moe_tiny", override]))
