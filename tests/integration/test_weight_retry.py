"""No retry storm on a refused weight step (issue 35 item 5), against the real embedded server.

With the newest step poisoned and the trainer slow, the orchestrator used to retry the load
every loop turn (9.6/s per worker), each retry pausing generation and re-reading and
re-hashing the whole step. Now a version a worker refused for its content (an HTTP answer
400: checksum, NaN, malformed index) is never retried (the intact step below it, or a newer
one, is loaded instead), and
a failure without such an answer (no answer, 5xx) is retried with exponential backoff.
"""
from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import pytest


from tests.integration.test_http_hostile import MODEL, TOKEN, serve
from tests.helpers.netutil import free_port
from workers.common.inference_client import InferenceClient
from workers.common.protocol import RunPaths
from workers.models.build import model_from_config
from workers.orchestrator.faults import WorkerPool
from workers.weights.coordinator import RetryPolicy
from workers.weights.filesystem.coordinator import FilesystemCoordinator
from workers.weights.filesystem.publisher import publish_step

CFG = SimpleNamespace(weights=SimpleNamespace(verify=False), trainer=SimpleNamespace(dtype="float32"),
                      inference=SimpleNamespace(dtype="float32", backend="embedded"))
log = logging.getLogger("test.weight_retry")


class Counting:
    """The real client, counting its weight loads (what each retry costs every worker)."""

    def __init__(self, client: InferenceClient):
        self.client, self.loads = client, []

    def __getattr__(self, name):
        return getattr(self.client, name)

    async def update_weights_from_disk(self, path, version, **kw):
        self.loads.append(version)
        return await self.client.update_weights_from_disk(path, version, **kw)

    async def pause_generation(self, **kw):
        self.loads.append("pause")
        return await self.client.pause_generation(**kw)

    async def continue_generation(self, **kw):
        self.loads.append("continue")
        return await self.client.continue_generation(**kw)


def test_a_version_refused_for_its_content_is_not_retried(tmp_path):
    paths = RunPaths(tmp_path)
    state = model_from_config(MODEL, "float32", "cpu").state_dict()
    publish_step(paths.root / "weights", 1, state, keep_last=50)
    publish_step(paths.root / "weights", 2, {k: v * 1.5 for k, v in state.items()}, keep_last=50)
    shard = paths.root / "weights" / "step_000002" / "model.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-4] ^= 0xFF  # a corrupt shard: every worker refuses it (checksum), every time
    shard.write_bytes(bytes(raw))

    async def run(session, base, engine, app):
        client = Counting(InferenceClient(base, TOKEN, session=session, timeout_s=30))
        pool = WorkerPool([client], num_misses=3, timeout_s=10, log=log)
        coord = FilesystemCoordinator(CFG, paths, log=log)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.0:  # the orchestrator's loop turns while the trainer is slow
            await coord.maybe_update(pool)
            await asyncio.sleep(0.02)
        stuck = (coord.version, list(client.loads), engine.weight_version)
        publish_step(paths.root / "weights", 3, {k: v * 1.01 for k, v in state.items()}, keep_last=50)
        await coord.maybe_update(pool)
        return stuck, coord.version, list(client.loads), engine.weight_version

    (version, loads, served), after, loads_after, served_after = serve(run)
    assert loads == [2, 1], loads  # poisoned v2 once (never again), then the intact v1 below it
    assert version == 1 and served == 1
    assert after == 3 and loads_after == [2, 1, 3] and served_after == 3


@pytest.mark.parametrize("backend", ["embedded", "sglang"])
def test_embedded_workers_generate_through_an_update_others_are_paused(tmp_path, backend):
    """An embedded engine stages a step while it generates and swaps it in between decode steps
    (workers/inference/embedded/weight_swap.py): the coordinator sends no pause; it pauses any other backend.
    A request running across the update finishes, its tokens tagged with the versions that sampled them."""
    paths = RunPaths(tmp_path)
    state = model_from_config(MODEL, "float32", "cpu").state_dict()
    publish_step(paths.root / "weights", 1, {k: v * 1.01 for k, v in state.items()}, keep_last=5)
    cfg = SimpleNamespace(weights=CFG.weights, trainer=CFG.trainer,
                          inference=SimpleNamespace(dtype="float32", backend=backend))

    async def run(session, base, engine, app):
        client = Counting(InferenceClient(base, TOKEN, session=session, timeout_s=30))
        pool = WorkerPool([client], num_misses=3, timeout_s=10, log=log)
        coord = FilesystemCoordinator(cfg, paths, log=log)
        long = asyncio.create_task(client.generate([1, 2, 3], temperature=0.0, max_new_tokens=40))
        while engine.num_generated_tokens < 2:  # the request is decoding
            await asyncio.sleep(0.005)
        await coord.maybe_update(pool)
        out = await long
        return list(client.loads), coord.pauses_generation, engine.weight_version, out.token_versions

    loads, pauses, served, versions = serve(run)
    assert served == 1 and pauses == (backend != "embedded")
    assert loads == ([1] if backend == "embedded" else ["pause", 1, "continue"]), loads
    assert versions[0] == 0 and versions == sorted(versions) and set(versions) <= {0, 1}  # old first, never back


def test_a_worker_that_does_not_answer_is_retried_with_backoff(tmp_path):
    paths = RunPaths(tmp_path)
    publish_step(paths.root / "weights", 1, model_from_config(MODEL, "float32", "cpu").state_dict(), keep_last=5)

    async def run():
        import aiohttp

        async with aiohttp.ClientSession() as session:
            client = Counting(InferenceClient(f"http://127.0.0.1:{free_port()}", TOKEN, session=session, timeout_s=1))
            pool = WorkerPool([client], num_misses=10**6, timeout_s=0.2, log=log)  # never marked dead here
            coord = FilesystemCoordinator(CFG, paths, log=log)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 3.0:
                await coord.maybe_update(pool)
                await asyncio.sleep(0.02)
            return len(client.loads), coord.version

    attempts, version = asyncio.run(run())
    assert version == 0
    assert 1 <= attempts <= 4, attempts  # 0.5 s, 1 s, 2 s apart: not one per loop turn (~100 here)


def test_retry_policy_backoff_and_refusals():
    now = [100.0]
    p = RetryPolicy(first_s=0.5, max_s=4.0, clock=lambda: now[0])
    assert p.due(5)
    p.failed(5, content=False)
    assert not p.due(5) and p.due(6)  # a newer version is tried at once
    now[0] += 0.5
    assert p.due(5)
    p.failed(5, content=False)
    now[0] += 0.9
    assert not p.due(5)
    now[0] += 0.1
    assert p.due(5)
    for _ in range(10):
        p.failed(5, content=False)
    now[0] += 4.0
    assert p.due(5)  # capped
    p.failed(5, content=True)
    now[0] += 1e6
    assert not p.due(5) and p.due(7)
    p.succeeded(7)
    assert p.due(8)


def test_retry_at_once_when_the_live_workers_change():
    """A worker marked dead no longer holds the update back: the backoff starts afresh."""
    now = [0.0]
    p = RetryPolicy(first_s=5.0, clock=lambda: now[0])
    p.failed(3, content=False, context=(0, 1))
    assert not p.due(3, context=(0, 1)) and p.due(3, context=(0,))
