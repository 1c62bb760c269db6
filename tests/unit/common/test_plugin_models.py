"""A model family registered from the test tree (tests/plugins/models_plugin.py: ``tiny_moe_scaled``)
is picked by the config, the plan and the roles through the registry alone, and really built.

No project file names the family: importing the plugin module registers it (the CLI and every
role do that from SLURMRL_PLUGINS / run.yaml ``plugins``), and ``model=tiny_moe_scaled`` is the
group option the config store makes from its schema.
"""
from __future__ import annotations

import torch

import tests.plugins.models_plugin as plugin
from launcher.config_store import register
from launcher.plan import PlanError, build_plan
from tests.helpers.netutil import free_port, gloo_dims
from tests.conftest import compose
from tests.unit.conftest import slurmrl
from workers.common.config import load_run_config
from workers.common.registry import MODELS

register()  # the plugin's schema and group option join the config store
SCALED = ["model=tiny_moe_scaled", "model.init_scale=0.25"]


def test_the_registry_config_and_plan_pick_it():
    assert MODELS.get("tiny_moe_scaled") is plugin.SPEC and plugin.SPEC.buildable
    cfg = compose(SCALED)
    assert type(cfg.model) is plugin.TinyMoeScaledConfig and cfg.model.init_scale == 0.25
    plan = build_plan(cfg)
    assert plan.params == build_plan(compose([])).params  # tiny_moe's shape: the same facts
    try:
        build_plan(compose([*SCALED, "model.init_scale=0"]))
        raise AssertionError("init_scale=0 planned")
    except PlanError as e:
        assert "model.init_scale" in str(e)


def test_the_cli_dry_run_records_the_plugin_for_the_roles(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURMRL_PLUGINS", "tests.plugins.models_plugin")
    res = slurmrl([*SCALED, "launcher.dry_run=true", f"cluster.runs_root={tmp_path / 'runs'}"], tmp_path)
    assert res.returncode == 0, res.stderr
    run_yaml = next((tmp_path / "runs").rglob("config/run.yaml"))
    cfg = load_run_config(str(run_yaml))  # what every role does: imports the plugins, then types the section
    assert "tests.plugins.models_plugin" in cfg.plugins and type(cfg.model) is plugin.TinyMoeScaledConfig
    res = slurmrl(["model=tiny_moe", "model.init_scale=2", "launcher.dry_run=true"], tmp_path)
    assert res.returncode == 2 and "model.init_scale" in res.stderr  # tiny_moe's own schema has no such field


def test_trainer_and_engine_build_it_with_its_own_weights():
    from workers.inference.embedded.engine import GenRequest, InferenceEngine
    from workers.models.build import model_from_config
    from workers.trainer.loop import initial_model, parallelize

    cfg, plain_cfg = compose(SCALED), compose([])
    scaled, plain = initial_model(cfg), initial_model(plain_cfg)
    assert type(scaled.config) is plugin.TinyMoeScaledConfig
    for (name, a), (_, b) in zip(sorted(scaled.state_dict().items()), sorted(plain.state_dict().items())):
        assert torch.allclose(a, b if name.endswith("norm.weight") else 0.25 * b), name  # different weights
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    dims = gloo_dims(0, 1, free_port())
    try:
        model = parallelize(cfg, scaled, dims)  # the trainer's shard, through the spec's parallelize
        out = model(ids)
        assert out.logits.shape == (1, 6, cfg.model.vocab_size) and out.routed_experts.shape == (1, 6, 4, 2)
        out.logits.logsumexp(-1).mean().backward()
        assert all(p.grad is not None for n, p in model.named_parameters() if ".experts." not in n)
        full = model.full_state_dict(to_rank=None)
    finally:
        torch.distributed.destroy_process_group()
    served = model_from_config(cfg.model, "float32")  # the embedded engine's build
    served.load_state_dict(full)
    engine = InferenceEngine(served, max_batch_size=2, seed=0).start()
    try:
        outs = engine.generate([GenRequest(input_ids=[1, 2, 3], max_new_tokens=4, temperature=1.0)], timeout_s=30)
    finally:
        engine.shutdown()
    assert len(outs[0].output_ids) == 4
