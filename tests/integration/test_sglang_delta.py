"""Sparse patches into SGLang servers (weights.delta), end to end without GPUs: two fake SGLang servers with
2 TP ranks each (tests/fakes/fake_sglang_weights.py: one process per rank; /update_weights_from_tensor runs
the --custom-weight-loader that load_format names, on every rank, as the pinned sglang does), the real
orchestrator side (SGLangBroadcastCoordinator) and trainer side (SGLangBroadcastPublisher in a thread).

Checks: versions offered as patches go as patches (descriptor over HTTP, the patch broadcast on SGLang's
group, applied by workers/weights/sglang/patch_loader.py in every rank) and leave every rank bit
for bit at the trainer's weights; an anchor due is written to run_dir/weights while the servers stay on
patches; a rank that does not hold the base refuses, and the version arrives through the filesystem for
every server.
"""
from __future__ import annotations

import asyncio
import logging
import types

import aiohttp
import torch

from tests.fakes.fake_sglang_weights import FakeWeightsConfig, serve_fake_sglang_weights
from tests.integration.test_sglang_broadcast import SERVERS, TP, Trainer, bf16, model_state, update
from workers.common.inference_client import InferenceClient
from workers.common.protocol import RunPaths, latest_stable_step
from workers.weights.broadcast import BroadcastWeightsConfig
from workers.weights.sglang.broadcast_coordinator import SGLangBroadcastCoordinator
from workers.weights.sglang.wire import DELTA_LOADER
from workers.weights.stream import DictStream

torch.set_num_threads(1)


def nudge(master, step, fraction=0.01):
    g = torch.Generator().manual_seed(step)
    for t in master.values():
        flat = t.reshape(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: max(1, int(fraction * flat.numel()))]
        flat[idx] += torch.randn(idx.numel(), generator=g) * 0.1


async def scenario(tmp_path):
    paths = RunPaths(tmp_path)
    paths.root.mkdir(parents=True, exist_ok=True)
    weights = BroadcastWeightsConfig(bucket_size_mb=1, broadcast_timeout_s=60, delta=True, delta_full_every=4)
    cfg = types.SimpleNamespace(weights=weights, inference=types.SimpleNamespace(
        num_workers=SERVERS, worker=types.SimpleNamespace(tp=TP)))
    master = model_state(0)
    fake_cfg = dict(tp_size=TP, custom_weight_loader=[DELTA_LOADER])
    async with serve_fake_sglang_weights(FakeWeightsConfig(state=bf16(master), **fake_cfg)) as (u0, f0), \
            serve_fake_sglang_weights(FakeWeightsConfig(state=bf16(master), **fake_cfg)) as (u1, f1):
        async with aiohttp.ClientSession() as session:
            clients = [InferenceClient(u, "tok", session=session, timeout_s=60) for u in (u0, u1)]
            coord = SGLangBroadcastCoordinator(cfg, paths, log=logging.getLogger("test"))
            trainer = Trainer(paths, weights)
            stream = DictStream(master, dtype=torch.bfloat16)
            trainer.publish(0, stream)
            await coord.start(clients)
            await asyncio.to_thread(trainer.join)

            async def step(v):
                nudge(master, v)
                trainer.publish(v, stream)
                await update(coord, trainer, v)
                for fake in (f0, f1):
                    for r in range(TP):
                        got = await asyncio.to_thread(fake.rank_state, r)
                        assert all(torch.equal(got[n].view(torch.int16), t.view(torch.int16))
                                   for n, t in bf16(master).items()), (v, fake, r)
                    assert fake.cfg.weight_version == str(v)
                return [r["path"] for r in f0.requests[-6:]]
            for v in (1, 2, 3):
                paths_seen = await step(v)
                assert "/update_weights_from_tensor" in paths_seen, paths_seen  # a patch
                assert trainer.pub.last_patch[0] > 0
            assert coord.verified == 3 and coord.fallbacks == 0, coord.last_refusal
            assert "/update_weights_from_tensor" in await step(4)  # an anchor is due: it goes to disk, servers patch
            assert latest_stable_step(paths.root / "weights") == 4 and coord.fallbacks == 0, coord.last_refusal
            assert "/update_weights_from_tensor" in await step(5)

            # a server rank that no longer holds the base: the patch is refused there, v comes from disk
            await asyncio.to_thread(f1.ranks[1].call, "corrupt_next", {"name": "lm_head.weight"})
            await asyncio.to_thread(f1.ranks[1].call, "load_disk", {"model_path": str(paths.weights(0))})
            await step(6)
            assert coord.fallbacks == 1 and coord.mismatched == 1
            assert "/update_weights_from_tensor" in await step(7)  # patches resume on the new anchor
            trainer.pub.close()
        return coord


def test_patches_reach_every_rank_of_two_servers_bit_exactly_and_a_refusal_falls_back_to_disk(tmp_path):
    coord = asyncio.run(scenario(tmp_path))
    assert coord.version == 7
