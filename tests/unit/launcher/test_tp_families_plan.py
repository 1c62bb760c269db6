"""Plan time for the native families of issue 43 under trainer.parallel.tp=2: every one plans onto the
mesh plan (gemma3_text and gpt_oss were refused before their tensor-parallel plans existed), and
GPT-OSS's expert parallelism is refused by its key with the reason (ModelSpec.no_expert_parallel).

Checkpoints are tiny directories transformers writes itself (tests/models/hf_dirs.py); the run
config comes through ``model.path`` as a user's would. World-2 parity of these plans:
tests/integration/test_tp_native_families.py.
"""
from __future__ import annotations

import pytest

from launcher.plan import PlanError, build_plan
from tests.models.hf_dirs import hf_dir
from tests.unit.launcher.test_generic_plan import resolved
from workers.common.registry import MODELS

FAMILIES = {  # family: (architecture, model_type, config overrides)
    "gemma3_text": ("Gemma3ForCausalLM", "gemma3_text", {"head_dim": 8}),
    "gpt_oss": ("GptOssForCausalLM", "gpt_oss", {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", {}),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", {}),
    "mistral": ("MistralForCausalLM", "mistral", {}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_families")
    return {f: hf_dir(root / f, arch, model_type, tokenizer_vocab=100, **kw)
            for f, (arch, model_type, kw) in FAMILIES.items()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tensor_parallel_2_plans_onto_the_mesh_plan(checkpoints, family):
    cfg = resolved(checkpoints[family], "trainer.num_ranks=2", "trainer.parallel.tp=2")
    assert cfg.model.family == family
    plan = build_plan(cfg)
    assert plan.trainer_dims.plan == "mesh"
    assert (plan.trainer_dims.tp, plan.trainer_dims.ep) == (2, 1)
    assert not [w for w in plan.trainer_dims.warnings if "parallel" in w], plan.trainer_dims.warnings


def test_gpt_oss_expert_parallel_is_refused_by_its_key(checkpoints):
    with pytest.raises(PlanError, match=r"trainer.parallel.ep\(2\) > 1: model family 'gpt_oss' has no expert-parallel "
                                        r"plan: its experts are fused \[E, H, 2I\] stacks .*; use ep=1"):
        build_plan(resolved(checkpoints["gpt_oss"], "trainer.num_ranks=2", "trainer.parallel.ep=2"))
    with pytest.raises(PlanError, match=r"trainer.parallel.ep\(2\) > 1"):  # a dry run is refused too
        build_plan(resolved(checkpoints["gpt_oss"], "trainer.num_ranks=4", "trainer.parallel.ep=2",
                            "trainer.parallel.tp=2", "launcher.dry_run=true"))


def test_the_specs_pick_the_mesh_plan_for_tp():
    for family in FAMILIES:
        spec = MODELS.get(family)
        assert (spec.trainer_plan(1, 1), spec.trainer_plan(2, 1)) == ("fsdp", "mesh"), family
    assert MODELS.get("qwen3_moe").trainer_plan(1, 2) == "mesh"  # families with per-expert stacks keep EP
