"""The embedded server against hostile clients and a crashing engine (issue 22), in-process:
the real aiohttp app (server.make_app) over a real engine, real sockets.

- a client that disconnects has its generation aborted and its batch slot freed;
- a full admission queue answers 429 with Retry-After, and InferenceClient backs off and
  retries within its deadline;
- idle, silent and half-sent connections are closed; a stalled body is a 408;
- non-UTF-8 Authorization bytes are a 401, a 100k-deep JSON body a 400;
- malformed step directories and FIFOs given to /update_weights_from_disk are 400s (fast);
- an engine crash (non-finite activations, in the prefill) answers every in-flight and queued
  request 503 promptly, /health turns 503 and weight loads are refused.
"""
from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp
import pytest
import torch
from aiohttp import web

from tests.helpers import engine_fault
from workers.common.inference_client import InferenceClient, InferenceError
from workers.inference.embedded import guards
from workers.inference.embedded.engine import InferenceEngine
from workers.models.build import model_from_config
from workers.inference.embedded.parsing import BODY_TIMEOUT
from workers.inference.embedded.server import make_app
from workers.models.tiny_moe.config import TinyMoeConfig
from workers.weights.filesystem.publisher import publish_step

torch.set_num_threads(1)
TOKEN = "hostile-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MODEL = TinyMoeConfig(name="tiny_moe", vocab_size=16, hidden_size=32, num_layers=1, num_heads=2, num_experts=4, top_k=2,
                      expert_intermediate_size=32, max_position_embeddings=4096)


def serve(fn, *, max_batch_size=4, max_queued=256, idle_s=None, body_s=None):
    """Run ``fn(session, base_url, engine, app)`` against a fresh server; returns its result."""
    async def main():
        engine = InferenceEngine(model_from_config(MODEL, "float32", "cpu"), max_batch_size=max_batch_size,
                                 seed=0).start()
        app = make_app(engine, admin_token=TOKEN, model_name="tiny_moe", max_queued=max_queued)
        if body_s is not None:
            app[BODY_TIMEOUT] = body_s
        # The server's own settings (server._serve), not aiohttp's TestServer, which turns on
        # handler cancellation and so would hide a missing disconnect check.
        runner = web.AppRunner(app, access_log=None, **guards.runner_kwargs(idle_s or 75.0))
        await runner.setup()
        sock = guards.listen("127.0.0.1", 0)
        await web.SockSite(runner, sock).start()
        try:
            async with aiohttp.ClientSession() as session:
                return await fn(session, f"http://127.0.0.1:{sock.getsockname()[1]}", engine, app)
        finally:
            await runner.cleanup()
            engine.shutdown()
    return asyncio.run(main())


def gen_body(n: int, temperature: float = 0.0) -> dict:
    return {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": n, "temperature": temperature}}


async def raw(base: str, data: bytes, *, wait_s: float = 5.0) -> tuple[bytes, float]:
    """Send raw bytes; (everything the server answered until it closed, seconds until it closed)."""
    host, port = base.split("//")[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    t0 = time.monotonic()
    writer.write(data)
    await writer.drain()
    got = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), wait_s):
            got += chunk
    except (asyncio.TimeoutError, ConnectionResetError):
        pass
    writer.close()
    return got, time.monotonic() - t0


def test_disconnect_aborts_the_generation_and_frees_the_slot():
    async def run(session, base, engine, app):
        task = asyncio.create_task(session.post(base + "/generate", json=gen_body(4000)))
        while engine.num_running == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        task.cancel()  # the client goes away: aiohttp closes the connection
        t0 = time.monotonic()
        while engine.num_running:
            await asyncio.sleep(0.01)
            assert time.monotonic() - t0 < 5, "the generation went on after its client disconnected"
        return time.monotonic() - t0, app[guards.DISCONNECTS].num_aborted, engine.num_generated_tokens

    stopped_s, aborted, tokens = serve(run)
    assert aborted == 1 and stopped_s < 1.0 and tokens < 4000


def test_full_queue_answers_429_and_the_client_backs_off_within_its_deadline():
    async def run(session, base, engine, app):
        await session.post(base + "/pause_generation", json={"mode": "in_place"}, headers=AUTH)
        held = [asyncio.create_task(session.post(base + "/generate", json=gen_body(2))) for _ in range(3)]
        while engine.num_pending < 3:
            await asyncio.sleep(0.01)
        async with session.post(base + "/generate", json=gen_body(2)) as r:
            refused = (r.status, r.headers.get("Retry-After"), (await r.json())["error"]["message"])
        async with session.post(base + "/generate", json={"input_ids": [[1, 2]] * 4}) as r:
            too_big = r.status
        client = InferenceClient(base, TOKEN, session=session, timeout_s=0.5)
        with pytest.raises(InferenceError) as short:
            await client.generate([1, 2], temperature=0.0, max_new_tokens=2)
        client.timeout_s = 20.0
        waiting = asyncio.create_task(client.generate([1, 2], temperature=0.0, max_new_tokens=2))
        await asyncio.sleep(1.2)
        await session.post(base + "/continue_generation", json={}, headers=AUTH)
        out = await waiting
        for t in held:
            (await t).release()
        return refused, too_big, short.value.status, out.finish_reason

    (status, retry_after, message), too_big, short_status, finish = serve(run, max_queued=3)
    assert status == 429 and retry_after == "1" and "max_queued_requests=3" in message
    assert too_big == 400 and short_status == 429 and finish == "length"


def test_idle_silent_and_half_sent_connections_are_closed():
    async def run(session, base, engine, app):
        _, idle_s = await raw(base, b"")  # connected, never sends a request
        _, partial_s = await raw(base, b"POST /generate HTTP/1.1\r\nHost: x\r\n")  # headers never finish
        stalled, stalled_s = await raw(base, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        return idle_s, partial_s, stalled.split(b"\r\n")[0], stalled_s

    idle_s, partial_s, status_line, stalled_s = serve(run, idle_s=0.5, body_s=0.5)
    assert idle_s < 3 and partial_s < 3 and stalled_s < 3
    assert b"408" in status_line


def test_non_utf8_authorization_and_deep_json_are_4xx():
    async def run(session, base, engine, app):
        bad_auth, _ = await raw(base, b"POST /abort_request HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\x80"
                                      b"\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
        deep = b"[" * 100_000 + b"]" * 100_000
        async with session.post(base + "/generate", data=deep) as r:
            deep_status, deep_text = r.status, await r.text()
        async with session.post(base + "/update_weights_from_disk", data=b'{"model_path":' + deep + b"}",
                                headers=AUTH) as r:
            deep_admin = r.status
        async with session.get(base + "/health_generate") as r:
            return bad_auth.split(b"\r\n")[0], deep_status, deep_text, deep_admin, r.status

    auth_line, deep_status, deep_text, deep_admin, health = serve(run)
    assert b" 401 " in auth_line and deep_status == 400 and "body" in deep_text and deep_admin == 400
    assert health == 200


RAW = {  # malformed at the HTTP level: aiohttp's parser answers 400/404 itself; never a 500
    "path_nul": b"POST /generate%00 HTTP/1.1\r\n", "path_dotdot": b"GET /../../etc/passwd HTTP/1.1\r\n",
    "path_bytes": b"GET /\xff\xfe HTTP/1.1\r\n", "path_long": b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n",
    "method": b"FOO /generate HTTP/1.1\r\n", "header_long": b"GET /health HTTP/1.1\r\nX: " + b"a" * 100000 + b"\r\n",
    "length_negative": b"POST /generate HTTP/1.1\r\nContent-Length: -5\r\n",
    "length_garbage": b"POST /generate HTTP/1.1\r\nContent-Length: abc\r\n",
    "chunk_garbage": b"POST /generate HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    "auth_empty": b"POST /pause_generation HTTP/1.1\r\nAuthorization: Bearer\r\nContent-Length: 0\r\n",
}


def test_malformed_http_requests_are_4xx_and_the_server_survives():
    async def run(session, base, engine, app):
        got = {}
        for name, head in RAW.items():
            answer, _ = await raw(base, head + b"Host: x\r\nConnection: close\r\n\r\n")
            got[name] = answer.split(b"\r\n")[0]
        async with session.get(base + "/health_generate") as r:
            return got, r.status

    got, health = serve(run)
    assert health == 200
    bad = {k: v for k, v in got.items() if not (v.split(b" ")[1:2] and v.split(b" ")[1].startswith(b"4"))}
    assert not bad, bad


def _damage_index(step, fn):
    index = json.loads((step / "index.json").read_text())
    fn(index)
    (step / "index.json").write_text(json.dumps(index))


STEP_DAMAGE = {
    "index_list": lambda s: (s / "index.json").write_text("[]"),
    "shape_strings": lambda s: _damage_index(s, lambda i: [m.__setitem__("shape", ["x"]) for m in i["tensors"].values()]),
    "dtype_unknown": lambda s: _damage_index(s, lambda i: [m.__setitem__("dtype", "f128") for m in i["tensors"].values()]),
    "hash_missing": lambda s: _damage_index(s, lambda i: [m.pop("xxh3") for m in i["tensors"].values()]),
    "map_int": lambda s: _damage_index(s, lambda i: [i["weight_map"].__setitem__(k, 1) for k in i["weight_map"]]),
    "map_outside": lambda s: _damage_index(s, lambda i: [i["weight_map"].__setitem__(k, "../../../etc/hostname")
                                                         for k in i["weight_map"]]),
    "shard_fifo": lambda s: ((s / "model.safetensors").unlink(), os.mkfifo(s / "model.safetensors")),
    "shard_symlink": lambda s: ((s / "model.safetensors").unlink(), (s / "model.safetensors").symlink_to("/dev/zero")),
    "index_fifo": lambda s: ((s / "index.json").unlink(), os.mkfifo(s / "index.json")),
}


def test_malformed_step_directories_are_400_and_a_fifo_never_blocks(tmp_path):
    state = model_from_config(MODEL, "float32", "cpu").state_dict()
    for i, (name, damage) in enumerate(sorted(STEP_DAMAGE.items())):
        publish_step(tmp_path / name, i + 1, state, keep_last=50)
        damage(tmp_path / name / f"step_{i + 1:06d}")

    async def run(session, base, engine, app):
        got = {}
        for i, name in enumerate(sorted(STEP_DAMAGE)):
            body = {"model_path": str(tmp_path / name / f"step_{i + 1:06d}"), "weight_version": i + 1}
            t0 = time.monotonic()
            async with session.post(base + "/update_weights_from_disk", json=body, headers=AUTH) as r:
                got[name] = (r.status, (await r.json())["message"][:200], time.monotonic() - t0)
        async with session.post(base + "/update_weights_from_disk", headers=AUTH,
                                json={"model_path": "/tmp/a\x00b", "weight_version": 1}) as r:
            got["nul_path"] = (r.status, (await r.json())["message"][:200], 0.0)
        return got, engine.weight_version

    got, version = serve(run)
    assert version == 0
    bad = {k: v for k, v in got.items() if v[0] != 400 or v[2] > 5 or not v[1]}
    assert not bad, bad


def test_engine_crash_fails_every_request_promptly_and_reports_unhealthy(monkeypatch):
    engine_fault.arm(1, monkeypatch)  # a device fault once weights v1 are live

    async def run(session, base, engine, app):
        head = engine.model.state_dict()["lm_head.weight"]
        engine.apply_weights({"lm_head.weight": head * 1.5}, 1, source="test: weights that meet a device fault")
        t0 = time.monotonic()
        calls = [session.post(base + "/generate", json=gen_body(50, temperature=1.0)) for _ in range(5)]
        answers = []
        for resp in await asyncio.wait_for(asyncio.gather(*calls), 10):
            answers.append((resp.status, (await resp.json())["error"]["message"]))
            resp.release()
        elapsed = time.monotonic() - t0
        async with session.get(base + "/health") as h, session.post(
                base + "/update_weights_from_disk", json={"model_path": "/x", "weight_version": 2}, headers=AUTH) as w:
            return answers, elapsed, h.status, w.status, engine.alive

    answers, elapsed, health, load, alive = serve(run, max_batch_size=2)  # 2 in prefill, 3 queued
    assert [s for s, _ in answers] == [503] * 5 and all("engine failed" in m for _, m in answers)
    assert elapsed < 10 and health == 503 and load == 503 and not alive
