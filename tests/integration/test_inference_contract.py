"""One client test suite, two servers: the embedded engine and a fake SGLang 0.5.23.

Why: the orchestrator drives SGLang on GPU clusters and the embedded engine locally with
the same InferenceClient (docs/design.md, "Protocols"). Every test in the shared suite runs
against both (``backend`` fixture), so a field the engine answers but SGLang does not (or
the reverse) breaks here, not on a cluster. The fake (tests/fakes/fake_sglang.py) answers
with SGLang's recorded request/response schema; the tests at the end cover what only
SGLang does (no routing shape in /model_info, string weight versions, start_len, the
router's routing-key header, readiness while a server is still loading).
"""
from __future__ import annotations

import asyncio
import signal
import threading

import aiohttp
import numpy as np
import pytest

from tests.fakes.fake_sglang import FakeSGLangConfig, expected_routing, serve_fake_sglang
from tests.integration.conftest import INIT_SEED, SERVER_MODEL as MODEL, TOKEN, start_server
from workers.common.inference_client import InferenceClient, InferenceError, wait_until_ready
from workers.common.protocol import PeerTimeout
from workers.inference.sglang.router_client import Router
from workers.weights.filesystem.coordinator import update_all_workers

SHAPE = dict(num_layers=MODEL["num_layers"], top_k=MODEL["top_k"], num_experts=MODEL["num_experts"])


class FakeThread:
    """A fake SGLang server on its own event loop thread (the tests use asyncio.run)."""

    def __init__(self, cfg: FakeSGLangConfig):
        self.cfg, self.ready, self.stop = cfg, threading.Event(), None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self):
        self.stop = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        async with serve_fake_sglang(self.cfg) as (url, fake):
            self.url, self.fake = url, fake
            self.ready.set()
            await self.stop.wait()

    def __enter__(self):
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(10)


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    from workers.models.tiny_moe.model import TinyMoeConfig, build_model
    from workers.weights.filesystem.publisher import publish_step
    run_dir = tmp_path_factory.mktemp("run")
    proc, url, paths = start_server(run_dir)
    model = build_model(TinyMoeConfig(**MODEL), seed=INIT_SEED)
    for step in (0, 1):  # step 1 = the same weights as version 1: the swap protocol, not the math
        publish_step(paths.root / "weights", step, model.state_dict(), keep_last=5)
    yield url, str(paths.weights(1))
    proc.send_signal(signal.SIGTERM)
    proc.wait(15)


@pytest.fixture(scope="module")
def fake():
    cfg = FakeSGLangConfig(vocab_size=MODEL["vocab_size"], api_key=TOKEN, enable_return_routed_experts=True,
                           weight_version="0", **SHAPE)
    with FakeThread(cfg) as server:
        yield server


@pytest.fixture(params=["embedded", "fake_sglang"])
def backend(request):
    """(url, a published weights dir, shape to pass) of each server kind."""
    if request.param == "embedded":
        url, weights = request.getfixturevalue("embedded")
        return url, weights, {}
    server = request.getfixturevalue("fake")
    return server.url, "/models/step_1", SHAPE  # SGLang's /model_info has no shape: the orchestrator passes it


def arun(fn):
    async def main():
        async with aiohttp.ClientSession() as session:
            return await fn(session)
    return asyncio.run(main())


def test_ready_then_generate_with_logprobs_and_routing(backend):
    url, _, shape = backend

    async def body(session):
        client = InferenceClient(url, TOKEN, session=session, timeout_s=30, **shape)
        await wait_until_ready([client], deadline_s=60)
        prompt = [1, 2, 3, 4]
        r = await client.generate(prompt, temperature=1.0, max_new_tokens=5, return_routed_experts=True, rid="c-1")
        assert 1 <= len(r.output_ids) <= 5 and len(r.output_logprobs) == len(r.output_ids)
        assert all(lp <= 0 for lp in r.output_logprobs) and r.finish_reason in ("length", "stop")
        assert len(r.token_versions) == len(r.output_ids) and r.weight_version >= 0
        assert r.routed_experts.dtype == np.uint8
        assert r.routed_experts.shape == (len(prompt) + len(r.output_ids) - 1, MODEL["num_layers"], MODEL["top_k"])
        assert int(r.routed_experts.max()) < MODEL["num_experts"] and r.prompt_tokens == len(prompt)
    arun(body)


def test_stop_token_ends_the_completion(backend):
    url, _, shape = backend

    async def body(session):
        client = InferenceClient(url, TOKEN, session=session, timeout_s=30, **shape)
        first = await client.generate([5, 6], temperature=0.0, max_new_tokens=4)
        stop = await client.generate([5, 6], temperature=0.0, max_new_tokens=4, stop_token_ids=[first.output_ids[0]])
        assert stop.output_ids == first.output_ids[:1] and stop.finish_reason == "stop"
    arun(body)


def test_pause_in_place_keeps_a_request_then_weights_swap(backend):
    url, weights, shape = backend

    async def body(session):
        client = InferenceClient(url, TOKEN, session=session, timeout_s=30, **shape)
        await client.pause_generation("in_place")
        pending = asyncio.create_task(client.generate([1, 2], temperature=1.0, max_new_tokens=3))
        await asyncio.sleep(0.3)
        assert not pending.done()  # kept, not aborted
        await client.continue_generation()
        assert len((await pending).output_ids) >= 1
        await update_all_workers([client], weights, 1)  # pause -> load -> continue, the loop's protocol
        after = await client.generate([1, 2], temperature=1.0, max_new_tokens=2)
        assert after.weight_version == 1 and set(after.token_versions) == {1}
        await client.flush_cache()
    arun(body)


def test_refused_weights_raise_with_the_remote_text(backend):
    url, _, shape = backend

    async def body(session):
        client = InferenceClient(url, TOKEN, session=session, timeout_s=30, **shape)
        with pytest.raises(InferenceError) as e:
            await client.update_weights_from_disk("relative/not/a/step", 7)
        assert e.value.url.endswith("/update_weights_from_disk") and e.value.status in (200, 400, 404)
    arun(body)


def test_routing_key_header_does_not_change_the_answer(backend):
    url, _, shape = backend

    async def body(session):
        router = Router(url, TOKEN, header="x-smg-routing-key", prefix="exp", session=session, timeout_s=30,
                        shape=tuple(shape.get(k) for k in ("num_layers", "top_k", "num_experts")))
        r = await router.for_group(3).generate([1, 2, 3], temperature=0.0, max_new_tokens=3)
        assert len(r.output_ids) == 3
    arun(body)


# ---- what only SGLang does (against the fake) --------------------------------------------


def test_sglang_model_info_has_no_shape_so_routing_needs_it_passed(fake):
    async def body(session):
        bare = InferenceClient(fake.url, TOKEN, session=session, timeout_s=10)
        with pytest.raises(InferenceError, match="pass them to InferenceClient"):
            await bare.generate([1, 2], temperature=1.0, max_new_tokens=2, return_routed_experts=True)
        info = await bare.get_model_info()
        assert "num_layers" not in info and info["weight_version"] == fake.cfg.weight_version
    arun(body)


def test_sglang_routed_experts_decode_to_the_server_rows(fake):
    async def body(session):
        client = InferenceClient(fake.url, TOKEN, session=session, timeout_s=10, **SHAPE)
        r = await client.generate([3, 4, 5], temperature=1.0, max_new_tokens=4, return_routed_experts=True)
        want = expected_routing(3 + len(r.output_ids), 0, SHAPE["num_layers"], SHAPE["top_k"], SHAPE["num_experts"])
        assert np.array_equal(r.routed_experts, want)
    arun(body)


def test_sglang_string_versions_and_unknown_fields(fake):
    async def body(session):
        client = InferenceClient(fake.url, TOKEN, session=session, timeout_s=10, **SHAPE)
        fake.cfg.weight_version = "default"  # SGLang's label before any update: not an integer
        r = await client.generate([1], temperature=1.0, max_new_tokens=2)
        assert r.weight_version == -1 and r.token_versions == [-1, -1]
        await client.update_weight_version(4)
        assert (await client.generate([1], temperature=1.0, max_new_tokens=1)).weight_version == 4
        async with session.post(fake.url + "/generate", json={"input_ids": [1], "return_token_versions": True},
                                headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            assert resp.status == 400 and "unexpected keyword argument" in await resp.text()
        bad = InferenceClient(fake.url, "wrong", session=session, timeout_s=10)
        with pytest.raises(InferenceError) as e:
            await bad.pause_generation()
        assert e.value.status == 401
    arun(body)


def test_router_sends_one_routing_key_per_group(fake):
    async def body(session):
        router = Router(fake.url, TOKEN, header="x-smg-routing-key", prefix="glm5", session=session, timeout_s=10,
                        shape=(SHAPE["num_layers"], SHAPE["top_k"], SHAPE["num_experts"]))
        fake.fake.requests.clear()
        await asyncio.gather(*(router.for_group(g).generate([1, 2], temperature=1.0, max_new_tokens=1)
                               for g in (7, 7, 8)))
        keys = sorted(r["routing_key"] for r in fake.fake.requests if r["path"] == "/generate")
        assert keys == ["glm5-g7", "glm5-g7", "glm5-g8"]
    arun(body)


def test_readiness_deadline_names_the_server_still_loading():
    cfg = FakeSGLangConfig(api_key=TOKEN, startup_s=3600.0)
    with FakeThread(cfg) as loading, FakeThread(FakeSGLangConfig(api_key=TOKEN)) as up:
        async def body(session):
            clients = [InferenceClient(u, TOKEN, session=session, timeout_s=5) for u in (up.url, loading.url)]
            with pytest.raises(PeerTimeout) as e:
                await wait_until_ready(clients, deadline_s=1.5, poll_s=0.2)
            assert "1/2 inference workers not ready" in str(e.value) and loading.url in str(e.value)
            assert up.url not in str(e.value).split("ready after")[1]
        arun(body)
