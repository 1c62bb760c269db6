"""Model families behind the registry (workers/models): per-family schemas refuse fields the family
does not use, plan-only families plan but never start, and every family answers the generic facts.

The plan's numbers for the big presets are pinned here (they feed launcher/estimate.py and the
simulator, benchmarks/sim); the buildable families' counted parameters equal their torch modules'.
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

PRESETS = {  # preset -> (family, total, active, mtp): the plan's counts before the families had homes
    "tiny_moe": ("tiny_moe", 3_417_216, 1_057_920, 0),
    "tiny_dense": ("llama", 593_024, 593_024, 0),
    "smollm2_135m": ("llama", 134_515_008, 134_515_008, 0),
    "gpu_moe_1b5": ("tiny_moe", 1_476_954_112, 419_989_504, 0),
    "glm5": ("glm_moe_dsa", 743_911_179_264, 41_784_689_664, 9_952_913_920),
    "kimi_k2": ("deepseek_v3", 1_026_408_209_408, 32_861_477_888, 0),
    "nemotron3_ultra": ("nemotron_h", 549_308_968_960, 56_058_818_560, 0),  # real hybrid counts (was MHA+MoE)
}
KV_KIB_BF16 = {"glm5": 87.75, "kimi_k2": 68.625, "nemotron3_ultra": 12.0}  # nemotron: 12 attention layers only


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_facts_are_unchanged(preset):
    family, total, active, mtp = PRESETS[preset]
    m = compose([f"model={preset}"]).model
    assert m.family == family and type(m) is MODELS.get(family).config
    p = count_params(m)  # what build_plan reports and sizes the memory estimates with
    assert (p.total, p.active, p.mtp) == (total, active, mtp)
    if preset in KV_KIB_BF16:
        assert MODELS.get(family).kv_bytes_per_token(m, 2) / 1024 == KV_KIB_BF16[preset]


@pytest.mark.parametrize("family", ["tiny_moe", "llama", "deepseek_v3", "glm_moe_dsa", "nemotron_h"])
def test_every_family_answers_the_generic_facts(family):
    spec = MODELS.get(family)
    assert spec.name == family and spec.config().family == family
    assert spec.buildable == (family in ("tiny_moe", "llama", "nemotron_h"))
    dense = family == "llama"
    m = spec.config()
    assert (m.num_experts == 0) == dense and (m.top_k == 0) == dense  # fields of MoE schemas, 0 from the base
    assert (spec.router_hook is None) == dense
    assert architecture(m).is_moe != dense


@pytest.mark.parametrize("preset", ["tiny_moe", "tiny_dense"])
def test_buildable_families_build_on_meta_and_count_what_they_build(preset):
    m = compose([f"model={preset}"]).model
    spec = MODELS.get(m.family)
    model = spec.build(m, device="meta", dtype="bfloat16")
    params = list(model.parameters())
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in params)
    assert sum(p.numel() for p in params) == spec.params(m).total
    assert spec.to_hf(model.state_dict()).keys() == model.state_dict().keys()  # HF names natively


@pytest.mark.parametrize("experiment", ["glm5_swe_28xh200", "kimi_k2_swe_32xh200"])
def test_plan_only_families_are_refused_when_a_run_would_start(experiment):
    cfg = compose([f"experiment={experiment}", "cluster=h200_ib", "launcher.dry_run=false"])
    with pytest.raises(PlanError, match=rf"model.family={cfg.model.family} \(model {cfg.model.name}\) can be "
                                        r"planned but not built yet.*launcher.dry_run=true"):
        build_plan(cfg)
    assert build_plan(compose([f"experiment={experiment}", "cluster=h200_ib"])).num_params > 0  # dry run: plans


def test_a_family_without_a_trainer_sharding_plan_is_refused_when_a_run_would_start():
    """nemotron_h builds and serves (the embedded engine) but has no ModelSpec.parallelize yet."""
    cfg = compose(["experiment=nemotron3_ultra_pd_20xh200", "cluster=h200_ib", "launcher.dry_run=false"])
    assert MODELS.get("nemotron_h").buildable and not MODELS.get("nemotron_h").parallelize
    with pytest.raises(PlanError, match=r"model.family=nemotron_h \(model nemotron3_ultra\) builds and serves, but the "
                                        r"trainer has no sharding plan.*launcher.dry_run=true"):
        build_plan(cfg)
    assert build_plan(compose(["experiment=nemotron3_ultra_pd_20xh200", "cluster=h200_ib"])).num_params > 0


@pytest.mark.parametrize("args, key, schema", [
    (["model=tiny_moe", "model.q_lora_rank=8"], "q_lora_rank", "TinyMoeConfig"),
    (["model=tiny_dense", "model.num_experts=8"], "num_experts", "LlamaConfig"),
    (["model=smollm2_135m", "model.top_k=2"], "top_k", "LlamaConfig"),
    (["model=glm5", "model.rope_theta=1e6"], "rope_theta", "GlmMoeDsaConfig"),
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
