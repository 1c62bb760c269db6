"""Bad input to every route of the embedded inference server: a 4xx with a reason naming the
field, never a crash (the server answers /health_generate afterwards); oversized bodies are
refused with 413; admin routes refuse a missing or wrong token. In-process: the real aiohttp
app (workers/inference/embedded/server.make_app) over a real engine with a tiny random model."""
from __future__ import annotations

import asyncio
import inspect
import json

import pytest
import torch
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from workers.inference.embedded.engine import InferenceEngine
from workers.models.build import model_from_config
from workers.inference.embedded.server import MAX_BODY_BYTES, make_app
from workers.models.tiny_moe.config import TinyMoeConfig

torch.set_num_threads(1)
TOKEN = "bad-input-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MODEL = TinyMoeConfig(name="tiny_moe", vocab_size=16, hidden_size=32, num_layers=1, num_heads=2, num_experts=4, top_k=2,
                    expert_intermediate_size=32, max_position_embeddings=64)
NOT_JSON, ARRAY = b"{not json", b"[1, 2]"

# (route, body) -> expected status; bytes bodies are sent raw, dicts as JSON.
CASES = [
    ("/generate", NOT_JSON, 400), ("/generate", ARRAY, 400), ("/generate", {}, 400),
    ("/generate", {"input_ids": "abc"}, 400), ("/generate", {"input_ids": [1, "x"]}, 400),
    ("/generate", {"input_ids": [1, 99]}, 400),  # outside the vocab
    ("/generate", {"input_ids": [1] * 10_000}, 400),  # longer than the model's positions
    ("/generate", {"input_ids": [1, 2], "sampling_params": [1]}, 400),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, 400),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "many"}}, 400),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, 400),  # SGLang: (0, 1]
    ("/generate", {"input_ids": [1, 2], "return_logprob": "yes"}, 400),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"no_such_field": 1}}, 400),
    ("/pause_generation", NOT_JSON, 400), ("/pause_generation", {"mode": "sleep"}, 400),
    ("/continue_generation", ARRAY, 400),
    ("/abort_request", {"rid": 7}, 400), ("/abort_request", {"abort_all": "yes"}, 400),
    ("/update_weight_version", {"new_version": "latest"}, 400), ("/update_weight_version", NOT_JSON, 400),
    ("/update_weights_from_disk", {}, 400), ("/update_weights_from_disk", {"model_path": 5}, 400),
    ("/update_weights_from_disk", {"model_path": "/nonexistent/step_000001", "weight_version": "1"}, 400),
    ("/update_weights_from_disk", {"model_path": "/tmp", "abort_all_requests": "no"}, 400),
    ("/init_weights_update_group", {}, 400),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 70000, "rank_offset": 1,
                                    "world_size": 2, "group_name": "g", "backend": "gloo"}, 400),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 2000, "rank_offset": 3,
                                    "world_size": 2, "group_name": "g", "backend": "gloo"}, 400),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 2000, "rank_offset": 1,
                                    "world_size": 2, "group_name": "g", "backend": "mpi"}, 400),
    ("/update_weights_from_distributed", {"group_name": "g", "load_format": "pickle"}, 400),
    ("/update_weights_from_distributed", NOT_JSON, 400),
    ("/destroy_weights_update_group", {}, 400),
    # issue 22: bodies that used to answer 500
    ("/generate", b"[" * 100_000 + b"]" * 100_000, 400), ("/pause_generation", b'{"a":' * 50_000 + b"1" + b"}" * 50_000, 400),
    ("/generate", b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}', 400),
    ("/update_weight_version", {"new_version": "9" * 5000}, 400), ("/update_weight_version", {"new_version": "\u0661"}, 400),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": [["float32"]], "shapes": [[1]], "group_name": "g",
                                          "weight_version": 1}, 400),
    ("/update_weights_from_disk", {"model_path": "/tmp/a\x00b", "weight_version": "1"}, 400),
    ("/update_weights_from_disk", {"model_path": "/" + "a" * 5000, "weight_version": "1"}, 400),
]
ADMIN = sorted({r for r, _, _ in CASES if r != "/generate"} | {"/shutdown", "/flush_cache"})
BODYLESS = {"/flush_cache", "/shutdown"}  # take no fields: any body is ignored, as in SGLang


def _app(engine):
    kw = {"weight_timeout_s": 5.0} if "weight_timeout_s" in inspect.signature(make_app).parameters else {}
    return make_app(engine, admin_token=TOKEN, model_name="tiny_moe", **kw)


def _post_routes(app) -> set[str]:
    return {r.resource.canonical for r in app.router.routes() if r.method == "POST"}


async def _with_server(fn):
    engine = InferenceEngine(model_from_config(MODEL, "float32", "cpu"), max_batch_size=4, seed=0).start()
    app = _app(engine)
    server = TestServer(app)
    await server.start_server()
    try:
        async with ClientSession() as session:
            return await fn(session, str(server.make_url("")).rstrip("/"), _post_routes(app))
    finally:
        await server.close()
        engine.shutdown()


async def _post(session, url, body, headers=AUTH):
    kw = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with session.post(url, headers=headers, **kw) as r:
        return r.status, await r.text()


def test_every_bad_request_gets_4xx_with_a_reason_and_the_server_survives():
    async def run(session, base, routes):
        uncovered = routes - BODYLESS - {r for r, _, _ in CASES}
        assert not uncovered, f"POST routes without a bad-input case: {sorted(uncovered)}"
        failures = []
        for route, body, want in [c for c in CASES if c[0] in routes]:
            status, text = await _post(session, base + route, body)
            body = json.loads(text) if text.startswith("{") else {}
            reason = body.get("error", {}).get("message") or body.get("message", "")  # SGLang's refusals: message
            unimplemented = status == 501 and "not implemented" in reason  # a route the engine only names
            if (status != want and not unimplemented) or not reason:
                failures.append(f"{route} {body!r:.80}: {status} {text[:200]}")
        async with session.get(base + "/health_generate") as r:
            assert r.status == 200, await r.text()
        return failures

    assert asyncio.run(_with_server(run)) == []


def test_oversized_body_is_refused_with_413():
    async def run(session, base, routes):
        big = json.dumps({"input_ids": [1] * (MAX_BODY_BYTES // 2)}).encode()
        assert len(big) > MAX_BODY_BYTES
        status, _ = await _post(session, base + "/generate", big)
        async with session.get(base + "/health") as r:
            return status, r.status

    assert asyncio.run(_with_server(run)) == (413, 200)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}])
def test_admin_routes_refuse_without_the_token(headers):
    async def run(session, base, routes):
        return {route: (await _post(session, base + route, {}, headers=headers))[0] for route in ADMIN if route in routes}

    assert set(asyncio.run(_with_server(run)).values()) == {401}


def test_unknown_route_and_wrong_method():
    async def run(session, base, routes):
        async with session.get(base + "/nope") as a, session.get(base + "/generate") as b:
            return a.status, b.status

    assert asyncio.run(_with_server(run)) == (404, 405)
