"""Sparse patches (weights.delta) through the real HTTP path: two embedded inference servers
(``python -m workers.inference`` subprocesses), the orchestrator's BroadcastCoordinator choosing patch
or whole model per version, this process as trainer rank 0 with the real BroadcastPublisher. Checks:
after every update both workers report the trainer's digest (bit-identical), patches are what most
versions send, a worker that does not hold a patch's base refuses it and keeps serving, and the next
version, sent whole, brings every worker back.
"""
from __future__ import annotations

import asyncio
import logging
import types

import aiohttp
import pytest
import torch

from tests.integration.test_weights_broadcast_http import MODEL, TOKEN, servers  # noqa: F401 (the fixture)
from workers.common.inference_client import InferenceClient, wait_until_ready
from workers.models.tiny_moe.model import TinyMoeConfig, build_model
from workers.weights.base import SoloPeers
from workers.weights.broadcast import BroadcastWeightsConfig
from workers.weights.broadcast.coordinator import BroadcastCoordinator
from workers.weights.broadcast.publisher import BroadcastPublisher
from workers.weights.checksums import state_digest, state_hashes
from workers.weights.filesystem.publisher import FilesystemPublisher

pytestmark = pytest.mark.slow
torch.set_num_threads(1)
DELTA = BroadcastWeightsConfig(bucket_size_mb=1, lone_tensor_mb=1, broadcast_timeout_s=30, verify=True, delta=True,
                               delta_full_every=5)


def nudge(state, step, fraction=0.01):
    """An optimizer step that moves ~fraction of every tensor's elements."""
    g = torch.Generator().manual_seed(step)
    for t in state.values():
        flat = t.reshape(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: max(1, int(fraction * flat.numel()))]
        flat[idx] += torch.randn(idx.numel(), generator=g) * 1e-2


def test_patches_over_http_stay_exact_and_a_worker_off_the_chain_is_brought_back(servers, tmp_path):  # noqa: F811
    paths, urls = servers
    state = build_model(TinyMoeConfig(**MODEL), seed=5).state_dict()
    pub = BroadcastPublisher(paths, DELTA, SoloPeers(), initial=FilesystemPublisher(
        paths.root / "weights", peers=SoloPeers(), keep_last=3), host="127.0.0.1", port=0, num_receivers=2)
    cfg = types.SimpleNamespace(weights=DELTA, trainer=types.SimpleNamespace(dtype="float32"), inference=types.SimpleNamespace(
        num_workers=2, dtype="float32", worker=types.SimpleNamespace(tp=1)))
    coord = BroadcastCoordinator(cfg, paths, log=logging.getLogger("test"))
    pool = types.SimpleNamespace(alive=[True, True], readmit=lambda w, v: None)

    async def body(session):
        clients = [InferenceClient(u, TOKEN, session=session, timeout_s=60) for u in urls]
        publish = asyncio.create_task(asyncio.to_thread(pub.publish, 0, state))  # step 0 on disk: workers boot
        await wait_until_ready(clients, deadline_s=90)
        await coord.start(clients)
        await publish

        async def update(version):
            nudge(state, version)
            sending = asyncio.create_task(asyncio.to_thread(pub.publish, version, state))
            while coord.requested_version != version:
                await coord.maybe_update(pool)
                await asyncio.sleep(0.005)
            stats = await sending
            return coord.version == version, stats

        dense_bytes = sum(t.numel() * t.element_size() for t in state.values())
        for v in range(1, 5):
            ok, stats = await update(v)
            assert ok and coord.verified == v and coord.mismatched == 0  # both workers report the trainer's digest
            assert 0 < stats.bytes < dense_bytes / 5  # patches: a fraction of the model
        # worker 1 goes back to step 0 on disk: it no longer holds the chain's base
        await clients[1].update_weights_from_disk(str(paths.root / "weights" / "step_000000"), 0,
                                                  allow_rollback=True)
        ok, _ = await update(5)  # due as an anchor anyway (delta_full_every=5): sent whole, both back in step
        assert ok and coord.mismatched == 0
        ok, _ = await update(6)
        assert ok
        await clients[1].update_weights_from_disk(str(paths.root / "weights" / "step_000000"), 0,
                                                  allow_rollback=True)
        ok, _ = await update(7)  # a patch worker 1 cannot apply: refused, it keeps serving what it had
        assert not ok and coord.need_full
        assert (await clients[1].get_model_info())["weight_version"] == "0"
        await clients[1].health_generate()
        ok, stats = await update(8)  # sent whole to everyone
        assert ok and stats.bytes == dense_bytes and not coord.need_full
        digests = [(await c.get_model_info()) for c in clients]
        assert all(d["weight_version"] == "8" for d in digests)
        ok, stats = await update(9)  # and patches resume
        assert ok and stats.bytes < dense_bytes / 5 and coord.verified >= 8

    async def main():
        async with aiohttp.ClientSession() as session:
            await body(session)
    try:
        asyncio.run(main())
    finally:
        pub.close()
    log = (paths.logs_dir / "inference_1.log").read_text()
    assert "applied patch v1" in log and "did not hold the patch's base" in log and "Traceback" not in log
    assert state_digest(state_hashes(state))  # the trainer's weights are finite and hashable to the end
