"""Embedded server under hostile load (issue 22): what a disconnect and a burst cost.

    PYTHONPATH=$PWD python -m benchmarks.http_hygiene [--burst 3000]

1. Disconnect: a client asks for a long generation and goes away after 0.5 s; how long (and
   how many tokens) does the engine keep generating for nobody?
2. Burst: N single-prompt /generate requests arrive (the engine paused until all are in,
   so the measurement does not depend on how fast this client can send), then one more
   through the orchestrator's InferenceClient (which retries 429s); how long does that next
   request take, and how many burst requests were answered 429?

It uses only make_app and the engine (the same calls exist before and after the change), so
pointing PYTHONPATH at an older checkout measures the "before" numbers. The server runs as
server._serve runs it (guards' runner settings when they exist), in this process.
Writes benchmarks/out/http_hygiene.json.
``--record`` writes into the tracked benchmarks/results/ instead (benchmarks/record.py).
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import time
from pathlib import Path

import aiohttp
import torch
from aiohttp import web

from workers.common.inference_client import InferenceClient
from workers.inference.embedded.engine import InferenceEngine
from workers.models.build import model_from_config
from workers.inference.embedded.server import make_app
from workers.models.tiny_moe.config import TinyMoeConfig
from benchmarks.record import results_dir

RESULTS = results_dir() / "http_hygiene.json"
MODEL = TinyMoeConfig(name="tiny_moe", vocab_size=16, hidden_size=64, num_layers=2, num_heads=4, num_experts=8, top_k=2,
                      expert_intermediate_size=64, max_position_embeddings=4096)
TOKEN = "bench"


async def start(max_batch_size: int):
    engine = InferenceEngine(model_from_config(MODEL, "float32", "cpu"), max_batch_size=max_batch_size, seed=0).start()
    app = make_app(engine, admin_token=TOKEN, model_name="tiny_moe")
    try:
        from workers.inference.embedded import guards
        runner = web.AppRunner(app, access_log=None, **guards.runner_kwargs(75.0))
        sock = guards.listen("127.0.0.1", 0)
    except ImportError:  # before issue 22: aiohttp's defaults
        import socket
        runner = web.AppRunner(app, access_log=None)
        sock = socket.create_server(("127.0.0.1", 0))
    await runner.setup()
    await web.SockSite(runner, sock).start()
    return engine, runner, f"http://127.0.0.1:{sock.getsockname()[1]}"


async def disconnect(max_new_tokens: int) -> dict:
    engine, runner, base = await start(64)
    try:
        async with aiohttp.ClientSession() as session:
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
            task = asyncio.create_task(session.post(base + "/generate", json=body))
            while engine.num_running == 0:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.5)
            task.cancel()
            t0, at_disconnect = time.monotonic(), engine.num_generated_tokens
            while engine.num_running and time.monotonic() - t0 < 120:
                await asyncio.sleep(0.005)
            return {"max_new_tokens": max_new_tokens, "ran_on_s": round(time.monotonic() - t0, 3),
                    "tokens_after_disconnect": engine.num_generated_tokens - at_disconnect}
    finally:
        await runner.cleanup()
        engine.shutdown()


async def burst(n: int, max_new_tokens: int) -> dict:
    engine, runner, base = await start(64)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}

            async def one():
                async with session.post(base + "/generate", json=body) as r:
                    await r.read()
                    return r.status
            auth = {"Authorization": f"Bearer {TOKEN}"}
            await (await session.post(base + "/pause_generation", json={"mode": "in_place"}, headers=auth)).read()
            t0 = time.monotonic()
            flood = [asyncio.create_task(one()) for _ in range(n)]
            seen, still = -1, 0
            while still < 20:  # the whole burst has arrived: queued, or answered 429
                now = engine.num_pending + sum(t.done() for t in flood)
                still, seen = (still + 1, seen) if now == seen else (0, now)
                await asyncio.sleep(0.05)
            await (await session.post(base + "/continue_generation", json={}, headers=auth)).read()
            client = InferenceClient(base, TOKEN, session=session, timeout_s=600)
            t1 = time.monotonic()
            await client.generate([4, 5, 6], temperature=0.0, max_new_tokens=max_new_tokens)
            next_s = time.monotonic() - t1
            statuses = await asyncio.gather(*flood)
            return {"burst": n, "max_new_tokens": max_new_tokens, "next_request_s": round(next_s, 3),
                    "burst_429": statuses.count(429), "burst_200": statuses.count(200),
                    "burst_total_s": round(time.monotonic() - t0, 3),
                    "admission_limit": inspect.signature(make_app).parameters.get("max_queued", None) is not None}
    finally:
        await runner.cleanup()
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--burst", type=int, default=3000)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--long", type=int, default=3000, help="max_new_tokens of the disconnected generation")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = {"disconnect": asyncio.run(disconnect(args.long)), "burst": asyncio.run(burst(args.burst, args.max_new_tokens))}
    print(json.dumps(out, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
