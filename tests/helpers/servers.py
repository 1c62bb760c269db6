"""An embedded inference server, as a process or as the in-process aiohttp app."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

from tests.helpers.configs import REPO
from tests.helpers.netutil import free_port
from workers.common.config import ClusterConfig, RunConfig
from workers.common.protocol import RunPaths
from workers.inference.embedded.config import EmbeddedInferenceConfig
from workers.models.tiny_moe.config import TinyMoeConfig
from workers.orchestrator.envs.reverse_digits import ReverseDigitsConfig



TOKEN = "test-admin-token"


SERVER_MODEL = dict(vocab_size=16, hidden_size=64, num_layers=2, num_heads=4, num_experts=8, top_k=2,
             expert_intermediate_size=64, max_position_embeddings=512)


INIT_SEED = 5


def start_server(run_dir: Path, *, fault_at_version: int | None = None, startup_timeout_s: float = 60):
    """The real server process; ``fault_at_version``: its engine fails (tests/helpers/engine_fault.py)
    once weights of that version are live."""
    port = free_port()
    cfg = RunConfig(cluster=ClusterConfig(name="local"), env=ReverseDigitsConfig(),
                    model=TinyMoeConfig(name="tiny_moe", init_seed=INIT_SEED, **SERVER_MODEL),
                    inference=EmbeddedInferenceConfig(max_batch_size=8, startup_timeout_s=startup_timeout_s,
                                                              num_threads=1))
    paths = RunPaths(run_dir).ensure()
    paths.run_config.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    paths.admin_token.write_text(TOKEN)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "RANK", "WORLD_SIZE"))}
    env.update(SLURMRL_ROLE="inference", SLURMRL_RUN_DIR=str(run_dir), SLURMRL_LOCAL="1", RANK="0",
               SLURMRL_INFERENCE_URLS=f"http://127.0.0.1:{port}", PYTHONPATH=str(REPO))
    log = open(run_dir / "inference.log", "w")
    argv = ["-m", "workers.inference"] if fault_at_version is None else \
        ["-m", "tests.helpers.engine_fault", str(fault_at_version)]
    proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", paths


async def with_embedded_app(model_cfg, fn, *, token: str = TOKEN):
    """``fn(session, base_url)`` against the real aiohttp app (make_app) over a real engine, in-process."""
    import aiohttp
    from aiohttp.test_utils import TestServer

    from workers.inference.embedded.engine import InferenceEngine
    from workers.models.build import model_from_config
    from workers.inference.embedded.server import make_app

    engine = InferenceEngine(model_from_config(model_cfg, "float32", "cpu"), max_batch_size=4, seed=0).start()
    server = TestServer(make_app(engine, admin_token=token, model_name="tiny_moe"))
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            return await fn(session, str(server.make_url("")).rstrip("/"))
    finally:
        await server.close()
        engine.shutdown()
