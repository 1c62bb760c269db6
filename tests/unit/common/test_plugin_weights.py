"""A weight transport registered from the test tree (tests/plugins/weights_plugin.py,
``fake_copy``) is chosen by config alone and really moves the weights: its publisher writes
raw tensor copies, its coordinator drives pause -> load -> verify -> continue against a real
embedded worker app over HTTP (the SGLang weight routes), and its receiver reads the copy;
the worker then holds exactly the trainer's tensors. No project file names it."""
from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp import web

import tests.plugins.weights_plugin as plugin
from launcher.config_store import register
from launcher.plan import PlanError, build_plan
from tests.helpers.netutil import free_port
from tests.conftest import compose
from workers.common.config import conform_sections
from workers.common.inference_client import InferenceClient
from workers.common.protocol import RunPaths
from workers.common.registry import TRANSPORTS
from workers.inference.embedded.engine import InferenceEngine
from workers.inference.embedded.server import make_app
from workers.models.tiny_moe.model import TinyMoeConfig, build_model
from workers.weights.coordinator import WeightCoordinator

register()  # the plugin's schema becomes the Hydra option weights/fake_copy
REPO = Path(__file__).resolve().parents[3]
TOKEN = "t"
MODEL = dict(vocab_size=16, hidden_size=32, num_layers=2, num_heads=2, num_experts=4, top_k=2,
             expert_intermediate_size=32, max_position_embeddings=64)


def test_selected_by_config_and_planned():
    by_group = compose(["weights=fake_copy", "weights.copy_dir=copies"])
    by_key = conform_sections(compose(["weights.transport=fake_copy"]))  # re-typed as the CLI does
    for cfg, copy_dir in ((by_group, "copies"), (by_key, "weights_copy")):
        assert type(cfg.weights) is plugin.FakeCopyWeightsConfig and cfg.weights.copy_dir == copy_dir
        assert TRANSPORTS.get(cfg.weights.transport) is plugin.SPEC
        build_plan(cfg)  # its check ran and passed
    with pytest.raises(PlanError, match="weights.copy_dir"):
        build_plan(compose(["weights=fake_copy", "weights.copy_dir=/abs"]))


def test_a_field_of_another_transport_is_refused_by_name(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "launcher", f"cluster.runs_root={tmp_path}", "weights=filesystem",
                           "weights.bucket_size_mb=8", "launcher.dry_run=true"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "bucket_size_mb" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


class Pool:
    """The two calls a coordinator makes on the orchestrator's WorkerPool."""

    def __init__(self, clients):
        self.clients = clients

    def live_clients(self):
        return self.clients

    async def check_live(self):
        return []


@pytest.mark.slow  # starts an embedded inference server
def test_publisher_coordinator_receiver_move_real_weights(tmp_path):
    cfg = compose(["weights=fake_copy"])
    paths = RunPaths(tmp_path).ensure()
    spec = TRANSPORTS.get(cfg.weights.transport)
    pub = spec.publisher(cfg, paths, None, rank=0, world_size=1)
    coord = spec.coordinator(cfg, paths, log=logging.getLogger("test"))
    assert isinstance(coord, WeightCoordinator)
    trainer = build_model(TinyMoeConfig(**MODEL), seed=3).state_dict()
    pub.publish(0, trainer)  # step 0 through the filesystem: the worker boots from it
    engine = InferenceEngine(build_model(TinyMoeConfig(**MODEL), seed=9), max_batch_size=4, seed=0)
    engine.update_weights_from_disk(str(paths.weights(0)), 0)
    engine.start()
    v1 = {k: v + 0.25 for k, v in trainer.items()}
    v2 = {k: v - 0.5 for k, v in trainer.items()}

    async def main():
        runner = web.AppRunner(make_app(engine, admin_token=TOKEN, model_name="tiny", weights=cfg.weights))
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with aiohttp.ClientSession() as session:
                pool = Pool([InferenceClient(f"http://127.0.0.1:{port}", TOKEN, session=session, timeout_s=30)])
                await coord.maybe_update(pool)
                assert coord.version == 0  # nothing newer yet
                pub.publish(1, v1)
                await coord.maybe_update(pool)
                assert coord.version == 1 and coord.verified == 1 and coord.mismatched == 0
                pub.publish(2, v2)
                copy = tmp_path / "weights_copy" / "v_000002"
                raw = bytearray((copy / "0.bin").read_bytes())
                raw[0] ^= 1
                (copy / "0.bin").write_bytes(bytes(raw))  # a flipped bit: the receiver must refuse it
                await coord.maybe_update(pool)
                assert coord.version == 1
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
        pub.close()
    applied = json.loads((tmp_path / "weights_copy" / "v_000001" / "APPLIED.json").read_text())
    assert applied["ok"] and applied["version"] == 1
    assert not (tmp_path / "weights_copy" / "v_000002" / "APPLIED.json").exists()
    assert engine.weight_version == 1 and engine.model_path.endswith("v_000001")  # came through the copy
    assert sorted(p.name for p in paths.root.joinpath("weights").iterdir()) == ["step_000000"]  # not the filesystem
    held = engine.model.state_dict()
    assert all(torch.equal(held[k], v1[k]) for k in v1)
