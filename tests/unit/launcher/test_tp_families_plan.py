"""Plan time for the native families of issue 43 under trainer.parallel.tp=2: every one plans onto the
mesh plan (gemma3_text and gpt_oss were refused before their tensor-parallel plans existed), and
GPT-OSS plans expert parallelism (ep 2, ep 2 x tp 2) onto it too (its fused stacks are sharded over
the ep mesh: workers/models/blocks/moe_gpt_oss.py; world-2 parity and state paths:
tests/integration/test_gpt_oss_expert_parallel.py).

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


@pytest.mark.parametrize("overrides", [("trainer.num_ranks=2", "trainer.parallel.ep=2"),
                                       ("trainer.num_ranks=4", "trainer.parallel.ep=2", "trainer.parallel.tp=2")],
                         ids=["ep2", "ep2-tp2"])
def test_gpt_oss_expert_parallel_plans_onto_the_mesh_plan(checkpoints, overrides):
    plan = build_plan(resolved(checkpoints["gpt_oss"], *overrides))
    assert plan.trainer_dims.plan == "mesh"
    assert plan.trainer_dims.ep == 2
    assert not [w for w in plan.trainer_dims.warnings if "parallel" in w], plan.trainer_dims.warnings


def test_gpt_oss_expert_parallel_must_divide_the_experts(checkpoints):
    with pytest.raises(PlanError, match=r"trainer.parallel.ep\(3\) must divide model.num_experts\(4\)"):
        build_plan(resolved(checkpoints["gpt_oss"], "trainer.num_ranks=3", "trainer.parallel.ep=3"))


def test_the_specs_pick_the_mesh_plan_for_tp():
    for family in FAMILIES:
        spec = MODELS.get(family)
        assert (spec.trainer_plan(1, 1), spec.trainer_plan(2, 1)) == ("fsdp", "mesh"), family
    for family in ("qwen3_moe", "gpt_oss"):  # per-expert stacks and GPT-OSS's fused ones alike
        assert MODELS.get(family).trainer_plan(1, 2) == "mesh"
