"""``inference.dtype=float8`` at plan time (workers/common/fp8_plan.py): refused, naming the key, where
it is not built (CPU engine, SGLang, LoRA, a GPU the config does not name as Hopper/Blackwell); planned
where it is, with the trainer publishing bf16 (what the engine holds and re-quantizes)."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from launcher.config_store import reject_unknown_keys
from launcher.plan import PlanError, build_plan
from tests.unit.launcher.test_invalid_configs import compose_cfg
from workers.common.dtypes import held_dtype

GPU = ["inference.dtype=float8", "inference.device=cuda", "cluster.num_gpus_per_node=1"]


def plan(overrides, tmp_path):
    composed = compose_cfg(overrides + [f"cluster.runs_root={tmp_path / 'runs'}"])
    reject_unknown_keys(composed)
    cfg = OmegaConf.to_object(composed)
    return cfg, build_plan(cfg)


@pytest.mark.parametrize("overrides, key", [
    (["inference.dtype=float8"], "inference.device=cuda"),
    (GPU, "cluster.preflight.gpu_name"),
    (GPU + ["cluster.preflight.gpu_name=A100"], "cluster.preflight.gpu_name='A100'"),
    (GPU + ["cluster.preflight.gpu_name=H100", "trainer.lora.rank=4"], "trainer.lora.rank"),
    (["inference=sglang", "inference.dtype=float8"], "inference.sglang.quantization=fp8"),
    (["inference.dtype=float16"], "inference.dtype"),
], ids=["cpu", "no_gpu_name", "ampere", "lora", "sglang", "float16"])
def test_float8_refused_where_not_built(overrides, key, tmp_path):
    with pytest.raises(PlanError) as err:
        plan(overrides, tmp_path)
    assert key in str(err.value)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("gpu", ["H100", "NVIDIA H200", "GH200", "B200"])
def test_float8_planned_on_a_named_fp8_gpu(gpu, tmp_path):
    cfg, p = plan(GPU + [f"cluster.preflight.gpu_name={gpu}"], tmp_path)
    assert cfg.inference.dtype == "float8" and held_dtype(cfg.inference.dtype) == "bfloat16"
    assert p.roles
