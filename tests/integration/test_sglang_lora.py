"""LoRA mode into SGLang servers through SGLang's own protocol (issue 44 item 3), against the fake SGLang.

Each published adapter step is loaded by name (``<adapter>@v<V>``, /load_lora_adapter with the step
directory), confirmed by SGLang's own answer listing it, and only then do requests carry it
(``lora_path``) and get tagged with its version; the name it replaces is unloaded afterwards. A server
that answers success without the adapter among its loaded ones (a broken delivery) is quarantined.
"""
from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import aiohttp
import torch

from tests.fakes.fake_sglang import FakeSGLangConfig, serve_fake_sglang
from workers.common.inference_client import InferenceClient
from workers.common.protocol import RunPaths
from workers.orchestrator.faults import WorkerPool
from workers.weights.base import SoloPeers
from workers.weights.filesystem.publisher import FilesystemPublisher
from workers.weights.lora_coordinator import AdapterClient, SGLangLoraCoordinator
from workers.weights.lora_format import Adapter
from workers.weights.lora_publisher import AdapterPublisher

CFG = SimpleNamespace(weights=SimpleNamespace(verify=False), trainer=SimpleNamespace(
    dtype="float32", lora=SimpleNamespace(rank=2, alpha=4, targets=["q_proj"])), inference=SimpleNamespace(dtype="float32"))
log = logging.getLogger("test.sglang_lora")


def test_sglang_servers_load_confirm_and_serve_adapters_by_name(tmp_path, caplog):
    paths = RunPaths(tmp_path)
    root = paths.root / "weights"
    pub = AdapterPublisher(FilesystemPublisher(root, peers=SoloPeers(), keep_last=5), root, peers=SoloPeers(),
                           keep_last=5)
    pub.publish(0, {"model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 4)})
    ad = lambda s: Adapter({"model.layers.0.self_attn.q_proj": (torch.full((2, 4), s), torch.full((4, 2), s))},
                           rank=2, alpha=4)

    async def run():
        async with serve_fake_sglang(FakeSGLangConfig(enable_lora=True)) as (u0, fake0), \
                serve_fake_sglang(FakeSGLangConfig(enable_lora=True, lora_load_noop=True)) as (u1, fake1):
            async with aiohttp.ClientSession() as session:
                clients = [InferenceClient(u, "", session=session, timeout_s=10) for u in (u0, u1)]
                pool = WorkerPool(clients, num_misses=3, timeout_s=5, log=log)
                coord = SGLangLoraCoordinator(CFG, paths, log=log)
                base = await AdapterClient(clients[0], coord).generate([1, 2], temperature=1.0, max_new_tokens=2)
                pub.publish(1, ad(0.1))
                await coord.maybe_update(pool)
                first = (coord.version, dict(coord.quarantined), dict(fake0.loras))
                out = await AdapterClient(clients[0], coord).generate([1, 2], temperature=1.0, max_new_tokens=3)
                pub.publish(2, ad(0.2))
                await coord.maybe_update(pool)
                await asyncio.sleep(0.2)  # the replaced name is unloaded in the background
                sent = [r["body"].get("lora_path") for r in fake0.requests if r["path"] == "/generate"]
                pool.mark_dead(0, "test: a restart")
                fake0.loras.clear()  # a restarted server holds the base alone
                assert await coord.revive(pool, 0, None) and pool.alive[0] and list(fake0.loras) == ["default@v2"]
                return base, first, out, (coord.version, dict(fake0.loras)), sent

    with caplog.at_level(logging.ERROR, logger=log.name):
        base, (v1, quarantined, loaded), out, (v2, loaded2), sent = asyncio.run(run())
    assert base.token_versions == [0, 0]  # step 0: the base, no lora_path
    assert v1 == 1 and loaded == {"default@v1": str(root / "step_000001")}
    assert quarantined == {1: 1} and "NOT confirmed by inference worker 1" in caplog.text
    assert out.token_versions == [1, 1, 1] and out.weight_version == 1
    assert sent == [None, "default@v1"]
    assert v2 == 2 and loaded2 == {"default@v2": str(root / "step_000002")}
