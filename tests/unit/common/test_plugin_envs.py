"""A test-only env (tests/plugins/envs_plugin.py: ``count_up``) registered from the test tree:
the plan checks it through ENVS, the launcher composes and writes it (SLURMRL_PLUGINS), a role
loads it back from run.yaml, and the orchestrator's real episode runner runs a group of it
against the real embedded inference server (in-process aiohttp app over a real engine)."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

import tests.plugins.envs_plugin as plugin
from launcher.config_store import register
from launcher.plan import PlanError, build_plan
from tests.conftest import compose
from workers.common.inference_client import InferenceClient
from workers.common.registry import ENVS
from workers.orchestrator.batch_builder import build_batch_arrays
from workers.orchestrator.envs import make_env
from workers.orchestrator.episodes import run_episode_group

REPO = Path(__file__).resolve().parents[3]
register()  # stores env/count_up (the plugin has no YAML: its dataclass is the option)


def test_registry_and_plan_check_the_plugin_env():
    assert "count_up" in ENVS.names() and ENVS.get("count_up") is plugin.SPEC
    cfg = compose(["env=count_up", "env.count=4"])
    assert type(cfg.env) is plugin.CountUpConfig and cfg.env.count == 4
    assert build_plan(cfg).roles
    with pytest.raises(PlanError, match=r"env\.count must be > 0"):
        build_plan(compose(["env=count_up", "env.count=0"]))  # the env's own check
    with pytest.raises(PlanError, match=r"model\.vocab_size\(8\) is smaller than env count_up's vocabulary \(14\)"):
        build_plan(compose(["env=count_up", "model.vocab_size=8"]))  # its vocabulary need
    with pytest.raises(PlanError, match="env.latency_median_s"):
        build_plan(compose(["env=count_up", "env.latency=lognormal"]))  # the checks every env shares
    with pytest.raises(Exception, match="min_digits"):
        compose(["env=count_up", "env.min_digits=3"])  # reverse_digits' field: not in its schema


def test_launcher_writes_it_and_a_role_loads_it_back(tmp_path):
    env = {**os.environ, "SLURMRL_PLUGINS": "tests.plugins.envs_plugin", "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-m", "launcher", "env=count_up", "env.count=2", "launcher.dry_run=true",
                          f"cluster.runs_root={tmp_path}"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    run_yaml = next(tmp_path.glob("*/config/run.yaml"))
    env.pop("SLURMRL_PLUGINS")  # a role on another node: only run.yaml's plugins list
    code = ("from workers.common.config import load_run_config; from workers.orchestrator.envs import make_env; "
            f"c = load_run_config({str(run_yaml)!r}); e = make_env(c.env, seed=0, model=c.model); "
            "print(type(c.env).__name__, c.env.count, type(e).__name__, c.plugins)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[:3] == ["CountUpConfig", "2", "CountUpEnv"] and "tests.plugins.envs_plugin" in out.stdout


@pytest.mark.slow  # starts an embedded inference server
def test_episode_runner_plays_it_against_the_embedded_server():
    from workers.inference.embedded.engine import InferenceEngine
    from workers.models.build import model_from_config
    from workers.inference.embedded.server import make_app

    torch.set_num_threads(1)
    cfg = compose(["env=count_up"])
    env = make_env(cfg.env, seed=0, model=cfg.model)
    task = env.sample_task()
    m = cfg.model

    async def run():
        engine = InferenceEngine(model_from_config(m, "float32", "cpu"), max_batch_size=8, seed=0).start()
        server = TestServer(make_app(engine, admin_token="t", model_name=m.name))
        await server.start_server()
        try:
            async with ClientSession() as session:
                client = InferenceClient(str(server.make_url("")), "t", session=session, timeout_s=60)
                return await run_episode_group(client, env, task, group_id=0, worker=0, num_samples=6,
                                               temperature=1.0, return_routed_experts=True, started_version=0)
        finally:
            await server.close()
            engine.shutdown()

    group = asyncio.run(run())
    assert len(group.samples) == 6 and group.env_metrics == {}  # single-turn: no env/<name>/ metrics
    for s in group.samples:
        assert s.prompt_ids == list(task.prompt_ids) and 1 <= len(s.completion_ids) <= cfg.env.count + 1
        assert s.reward == env.score(task, s.completion_ids)
        assert s.token_rewards == env.token_rewards(task, s.completion_ids)
        assert s.completion_mask == [1] * len(s.completion_ids) and len(s.completion_logprobs) == len(s.completion_ids)
        assert s.routed_experts.shape == (len(s.prompt_ids) + len(s.completion_ids) - 1, m.num_layers, m.top_k)
    group.assign_advantages("token_rtg")
    assert all(s.token_advantages is not None for s in group.samples)
    arrays = build_batch_arrays([group], num_layers=m.num_layers, top_k=m.top_k)
    assert arrays["advantages"].ndim == 2 and arrays["loss_mask"].sum() == sum(len(s.completion_ids)
                                                                               for s in group.samples)
