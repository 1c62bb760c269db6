"""A test-only inference backend (tests/plugins/backends_plugin.py) registered from the test tree.

The plan finds it through the registry (its schema, its check, its placement facts), and a real
server task started the way the launcher starts one (``python -m workers.inference``) runs it
through its spec: the spec execs the backend's own command, which serves SGLang's HTTP API.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from omegaconf import OmegaConf

import tests.plugins.backends_plugin as plugin
from launcher.config_store import register
from launcher.plan import PlanError, build_plan
from tests.helpers.netutil import free_port
from tests.conftest import compose
from workers.common.config import ClusterConfig, RunConfig
from workers.common.inference_client import InferenceClient, wait_until_ready
from workers.common.protocol import RunPaths
from workers.common.registry import BACKENDS
from workers.orchestrator.envs.reverse_digits import ReverseDigitsConfig

REPO = Path(__file__).resolve().parents[3]
TOKEN = "plugin-test-token"
MODEL = dict(vocab_size=16, hidden_size=32, num_layers=2, num_heads=4, num_experts=4, top_k=2,
             expert_intermediate_size=32, max_position_embeddings=64)
register()  # store the plugin's schema as the Hydra option inference/fake_embedded_cli


def test_the_registry_and_the_plan_pick_the_plugin_backend():
    assert BACKENDS.get(plugin.NAME) is plugin.SPEC and plugin.NAME in BACKENDS.names()
    cfg = compose(["inference=fake_embedded_cli", "inference.greeting=hi there"])
    assert type(cfg.inference) is plugin.FakeEmbeddedCliConfig and cfg.inference.greeting == "hi there"
    p = build_plan(cfg)
    assert p.inference_backend == plugin.NAME and p.backend_steps == ()
    assert p.role("inference").description == "inference: 2 fake_embedded_cli server(s), 1 per node"
    slurm = build_plan(compose(["cluster=local_slurm", "inference=fake_embedded_cli"]))
    assert not any(r.role == "router" for r in slurm.roles) and slurm.role("inference").num_gpus_per_node == 0


def test_the_plugin_check_and_schema_refuse_naming_the_key():
    with pytest.raises(PlanError, match="inference.greeting is empty"):
        build_plan(compose(["inference=fake_embedded_cli", "inference.greeting= "]))
    with pytest.raises(Exception, match="greeting"):  # the embedded schema has no such field
        compose(["inference=embedded", "inference.greeting=hi"])


def write_run(run_dir: Path, port: int, greeting: str) -> RunPaths:
    """A run dir as the launcher leaves it for a server task: run.yaml (naming the plugin), token, step-0 weights."""
    import torch

    from workers.models.tiny_moe.model import TinyMoeConfig, build_model
    from workers.weights.filesystem.publisher import publish_step

    torch.set_num_threads(1)
    cfg = RunConfig(cluster=ClusterConfig(name="local"), env=ReverseDigitsConfig(),
                    model=TinyMoeConfig(name="tiny_moe", **MODEL), plugins=[plugin.ENTRY],
                    inference=plugin.FakeEmbeddedCliConfig(greeting=greeting, max_batch_size=4, startup_timeout_s=60))
    paths = RunPaths(run_dir).ensure()
    paths.run_config.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    paths.admin_token.write_text(TOKEN)
    publish_step(paths.root / "weights", 0, build_model(TinyMoeConfig(**MODEL), seed=1).state_dict(), keep_last=2)
    return paths


@pytest.mark.slow  # starts an inference server process
def test_a_server_started_through_the_plugin_spec_answers_generate(tmp_path):
    port = free_port()
    write_run(tmp_path, port, "hi there")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "RANK", "WORLD_SIZE", "SLURMRL_"))}
    env.update(SLURMRL_ROLE="inference", SLURMRL_RUN_DIR=str(tmp_path), SLURMRL_LOCAL="1", RANK="0",
               SLURMRL_INFERENCE_URLS=f"http://127.0.0.1:{port}", PYTHONPATH=str(REPO))
    log = tmp_path / "inference.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "workers.inference"], cwd=REPO, env=env, stdout=fh,
                                stderr=subprocess.STDOUT)
    try:
        async def body():
            async with aiohttp.ClientSession() as session:
                client = InferenceClient(f"http://127.0.0.1:{port}", TOKEN, session=session, timeout_s=30)
                await wait_until_ready([client], deadline_s=90)
                info = await client.get_model_info()
                out = await client.generate([1, 2, 3], temperature=0.0, max_new_tokens=4)
                return info, out
        info, out = asyncio.run(body())
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    text = log.read_text()
    assert (info["backend"], info["greeting"], info["num_experts"]) == (plugin.NAME, "hi there", 4), text
    assert len(out.output_ids) == 4 and out.weight_version == 0
    assert f"exec {sys.executable} -m {plugin.ENTRY} --greeting hi there" in text  # its own launch command
    assert "fake_embedded_cli says 'hi there'" in text and proc.returncode == 0, text
