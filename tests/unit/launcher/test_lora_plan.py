"""``trainer.lora`` at plan time (launcher/lora_plan.py): what the plan prints for a LoRA run
(trainable parameters, trainer memory with a frozen bf16 base, adapter bytes per update), the
learning-rate hint, and every bad setting refused naming its key, before anything is written."""
from __future__ import annotations

import pytest

from tests.helpers.configs import compose, plan, plan_error
from workers.common.config import ConfigError

QWEN_8 = ["model=qwen3_30b_a3b", "cluster=h200_ib", "trainer.dtype=bfloat16", "inference.dtype=bfloat16",
          "trainer.num_ranks=8"]


def test_plan_prints_trainable_params_memory_and_adapter_bytes():
    lines = plan(["trainer.lora.rank=8", "trainer.lr=1e-4"]).summary()
    lora = next(line for line in lines if line.startswith("lora: "))
    assert "rank 8" in lora and "trainable params" in lora and "no fp32 master" in lora
    update = next(line for line in lines if line.startswith("weights: "))
    assert "every update is the adapter" in update and "dense" in update
    assert not any("looks like a full-fine-tuning" in line for line in lines)


def test_lora_memory_is_a_frozen_bf16_base_plus_fp32_adapters():
    full = next(m for m in plan(QWEN_8).memory if m.what == "trainer")
    lora = next(m for m in plan([*QWEN_8, "trainer.lora.rank=32", "trainer.lr=1e-4"]).memory if m.what == "trainer")
    assert "frozen bfloat16 base 2 B x 30.5B" in lora.detail and "LoRA 16 B x" in lora.detail
    assert lora.per_gpu_gb < full.per_gpu_gb - 40  # 16 B/param of 30.5B over 8 GPUs: ~61 GB; LoRA ~10 GB


def test_full_fine_tuning_lr_gets_the_lora_hint():
    warnings = plan(["trainer.lora.rank=8", "trainer.lr=1e-6"]).trainer_dims.warnings
    assert any("trainer.lr=1e-06" in w and "10x" in w and "trainer.lr=1e-05" in w for w in warnings)


@pytest.mark.parametrize("overrides, key", [
    (["trainer.lora.rank=-1"], "trainer.lora.rank"),
    (["trainer.lora.rank=8", "trainer.lora.alpha=0"], "trainer.lora.alpha"),
    (["trainer.lora.rank=8", "trainer.lora.dropout=1.5"], "trainer.lora.dropout"),
    (["trainer.lora.rank=8", "trainer.lora.experts=some"], "trainer.lora.experts"),
    (["trainer.lora.rank=8", "trainer.lora.targets=[qkv]"], "trainer.lora.targets"),
    (["trainer.lora.rank=8", "trainer.lora.targets=[up_proj]"], "trainer.lora.targets"),  # MLP names on a MoE model
    (["trainer.lora.rank=8", "trainer.lora.targets=[mamba]"], "trainer.lora.targets"),  # nothing adapted
    (["trainer.lora.rank=8", "trainer.num_ranks=2", "trainer.parallel.ep=2"], "trainer.lora.rank"),
])
def test_bad_lora_settings_are_refused_naming_the_key(overrides, key):
    assert key in plan_error(overrides)


def test_the_router_is_refused_by_name():
    with pytest.raises(ConfigError, match="trainer.lora.targets has 'gate': the MoE router is never adapted"):
        compose(["trainer.lora.rank=8", "trainer.lora.targets=[attention,gate]"])


MIX = ["env=mix", "trainer.lora.rank=8", "trainer.lr=1e-4", "trainer.lora.targets=[attention]"]


def test_several_adapters_plan_prints_each_and_the_bytes_per_update():
    lines = plan([*MIX, "trainer.lora.adapters=[short,long]"]).summary()
    lora = next(line for line in lines if line.startswith("lora: "))
    assert "2 adapters ['short', 'long'] on one frozen base" in lora
    update = next(line for line in lines if line.startswith("weights: "))
    assert "the 2 adapters ['short', 'long'] (weights/step_N/adapters/<name>/" in update
    one = next(line for line in plan(MIX).summary() if line.startswith("lora: "))
    assert one.split(": ")[-1] != lora.split(": ")[-1]  # twice the adapter parameters


@pytest.mark.parametrize("adapters, match", [
    ("[short,short]", "names must be unique"),
    ("[short,base]", "'base' is reserved"),
    ("[short]", "name 2 to 8 adapters"),
    ("[a,b,c,d,e,f,g,h,i]", "name 2 to 8 adapters"),
    ("['9lives',long]", "must be an adapter name"),
    ("['../x',long]", "must be an adapter name"),
])
def test_bad_adapter_names_are_refused_naming_the_key(adapters, match):
    with pytest.raises(ConfigError, match=rf"trainer.lora.adapters=.*{match}"):
        compose([*MIX, f"trainer.lora.adapters={adapters}"])


def test_several_adapters_need_lora():
    with pytest.raises(ConfigError, match="trainer.lora.adapters=.* with trainer.lora.rank=0"):
        compose(["env=mix", "trainer.lora.adapters=[short,long]"])


@pytest.mark.parametrize("overrides, match", [
    (["env=reverse_digits", "trainer.lora.rank=8", "trainer.lora.targets=[attention]"], "with env=reverse_digits: "
                                                                                        "each adapter trains on its own env"),
    ([*MIX[1:], "env=mix", "env.weights.long=2"], None),  # labels short/long: accepted below, refused with other names
    (["trainer.lora.rank=8", "env=mix", "trainer.lora.targets=[attention]", "trainer.parallel.cp=2",
      "trainer.num_ranks=2"], "trainer.parallel.cp=1"),
    (["trainer.lora.rank=8", "env=mix"], "on a MoE model: several adapters adapt dense projections only"),
])
def test_several_adapters_refused_at_plan_time_where_not_built(overrides, match):
    if match is None:
        assert plan([*overrides, "trainer.lora.adapters=[short,long]"]).summary()
        assert "env.envs labels are ['long', 'short']" in plan_error([*overrides, "trainer.lora.adapters=[a,b]"])
        return
    assert match in plan_error([*overrides, "trainer.lora.adapters=[short,long]"])


def test_several_adapters_plan_on_sglang_servers():
    """SGLang serves every adapter by its versioned name (workers/weights/lora_coordinator.py): the plan passes
    and each server has room for two versions of each adapter plus the base (--max-loras-per-batch)."""
    from tests.unit.inference.sglang_cases import server_tasks

    assert plan(["inference=sglang", "cluster=h200_ib", *MIX, "trainer.lora.adapters=[short,long]"]).summary()
    for t in server_tasks("inference_sglang_adapters"):
        assert "--enable-lora" in t.argv and t.argv[t.argv.index("--max-loras-per-batch") + 1] == "5"
