"""An adapter that never reached the engine is detected (issue 44 item 3; verl #7495), over real HTTP.

Two real embedded servers in LoRA mode, the trainer's publisher writing step 0 (the base) and adapter
steps, the orchestrator's LoRA coordinator delivering them. Worker 1's delivery is broken on purpose:
its engine answers success but never copies the adapter (what verl's sync did for two months). The
coordinator must see that its digest is not the trainer's, stop sampling from it (no new groups, its
tokens under that version refused), say so in the log and the metrics, and keep the version moving on
the worker that confirmed. With every worker broken, the run stops after MAX_UNCONFIRMED versions.
"""
from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import aiohttp
import pytest
import torch
from aiohttp import web

from tests.integration.test_http_hostile import MODEL, TOKEN
from workers.common.inference_client import InferenceClient
from workers.common.protocol import RunPaths
from workers.inference.embedded import guards
from workers.inference.embedded.engine import InferenceEngine
from workers.models.build import model_from_config
from workers.inference.embedded.lora import EngineLora
from workers.inference.embedded.server import make_app
from workers.orchestrator.faults import WorkerPool
from workers.weights.base import SoloPeers
from workers.weights.filesystem.publisher import FilesystemPublisher
from workers.weights.lora_coordinator import MAX_UNCONFIRMED, AdapterNotDelivered, LoraCoordinator
from workers.weights.lora_format import Adapter
from workers.weights.lora_publisher import AdapterPublisher

TARGETS = ("q_proj", "v_proj", "experts")
CFG = SimpleNamespace(weights=SimpleNamespace(verify=False), trainer=SimpleNamespace(dtype="float32", lora=SimpleNamespace(
    rank=4, alpha=8, targets=TARGETS)), inference=SimpleNamespace(dtype="float32"))
log = logging.getLogger("test.lora_delivery")


def serve_two(fn, *, broken: tuple[int, ...]):
    async def main():
        engines, runners, urls = [], [], []
        for w in range(2):
            model = model_from_config(MODEL, "float32", "cpu")
            lora = EngineLora(model, rank=4, targets=TARGETS)
            if w in broken:
                lora.load = lambda *a, **k: None  # delivery broken on purpose: success, nothing copied
            engine = InferenceEngine(model, max_batch_size=4, seed=w, lora=lora).start()
            runner = web.AppRunner(make_app(engine, admin_token=TOKEN, model_name="tiny_moe"), access_log=None,
                                   **guards.runner_kwargs(75.0))
            await runner.setup()
            sock = guards.listen("127.0.0.1", 0)
            await web.SockSite(runner, sock).start()
            engines.append(engine)
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{sock.getsockname()[1]}")
        try:
            async with aiohttp.ClientSession() as session:
                clients = [InferenceClient(u, TOKEN, session=session, timeout_s=30) for u in urls]
                return await fn(clients, engines)
        finally:
            for r, e in zip(runners, engines):
                await r.cleanup()
                e.shutdown()
    return asyncio.run(main())


def publisher(paths):
    root = paths.root / "weights"
    return AdapterPublisher(FilesystemPublisher(root, peers=SoloPeers(), keep_last=5), root, peers=SoloPeers(),
                            keep_last=5)


def adapters_for(lora: EngineLora, n: int) -> list[Adapter]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        tensors = {t: (torch.randn(*p.a.shape[:-2], 4, p.a.shape[-1], generator=g) * 0.2,
                       torch.randn(*p.b.shape[:-1], 4, generator=g) * 0.2)
                   for t, p in {**lora.dense, **lora.stacks}.items()}
        out.append(Adapter(tensors, rank=4, alpha=8))
    return out


@pytest.fixture()
def published(tmp_path):
    paths = RunPaths(tmp_path)
    model = model_from_config(MODEL, "float32", "cpu")
    ads = adapters_for(EngineLora(model_from_config(MODEL, "float32", "cpu"), rank=4, targets=TARGETS), 4)
    pub = publisher(paths)
    pub.publish(0, model.state_dict())
    return paths, pub, ads


def test_an_undelivered_adapter_is_detected_and_not_sampled(published, caplog):
    """v1 reaches both workers; then worker 1's delivery breaks: it claims v2 while serving v1's adapter."""
    paths, pub, ads = published

    async def run(clients, engines):
        pool = WorkerPool(clients, num_misses=3, timeout_s=10, log=log)
        coord = LoraCoordinator(CFG, paths, log=log)
        for c in clients:  # both boot from the base (build_engine does this in a real worker)
            await c.update_weights_from_disk(str(paths.weights(0)), 0)
        pub.publish(1, ads[0])
        await coord.maybe_update(pool)
        first = (coord.version, dict(coord.quarantined))
        engines[1].lora.load = lambda *a, **k: None  # broken on purpose: answers success, copies nothing
        pub.publish(2, ads[1])
        await coord.maybe_update(pool)
        second = (coord.version, dict(coord.quarantined), coord.metrics(), [e.weight_version for e in engines])
        out = await clients[1].generate([1, 2, 3], temperature=0.0, max_new_tokens=3)  # a group in flight there
        del engines[1].lora.load  # repaired: the next version confirms and lifts the quarantine
        pub.publish(3, ads[2])
        await coord.maybe_update(pool)
        pool.mark_dead(1, "test: a restart")  # a revived worker gets the current adapter, confirmed, before it is live
        engines[1].lora.clear(0)
        revived = await coord.revive(pool, 1, None)
        assert revived and pool.alive[1] and engines[1].lora.digest() == engines[0].lora.digest()
        return first, second, out, coord

    with caplog.at_level(logging.ERROR, logger=log.name):
        first, (version, quarantined, metrics, served), out, coord = serve_two(run, broken=())
    assert first == (1, {})
    assert version == 2 and served == [2, 2]  # worker 1 claims v2 ...
    assert quarantined == {1: 2}  # ... but serves v1's adapter: no new groups there, its v2 tokens refused
    assert metrics == {"weight_updates_unconfirmed": 1, "inference_workers_quarantined": 1}
    assert set(out.token_versions) == {2} and coord.refuses(1, out.token_versions)
    assert not coord.refuses(0, out.token_versions)
    assert "weights v2 NOT confirmed by inference worker 1: adapter digest" in caplog.text
    assert "not sampling from it" in caplog.text
    assert coord.version == 3 and coord.quarantined == {} and coord.samples_from(1)


def test_adapters_that_reach_no_worker_stop_the_run(published):
    paths, pub, ads = published

    async def run(clients, engines):
        pool = WorkerPool(clients, num_misses=3, timeout_s=10, log=log)
        coord = LoraCoordinator(CFG, paths, log=log)
        for c in clients:
            await c.update_weights_from_disk(str(paths.weights(0)), 0)
        for v in range(1, MAX_UNCONFIRMED + 1):
            pub.publish(v, ads[v - 1])
            try:
                await coord.maybe_update(pool)
            except AdapterNotDelivered as e:
                return v, coord.version, str(e)
        return None

    stopped_at, version, why = serve_two(run, broken=(0, 1))
    assert stopped_at == MAX_UNCONFIRMED and version == 0  # never sampled from an unconfirmed adapter
    assert f"adapter versions 1..{MAX_UNCONFIRMED} were confirmed by no inference worker" in why
