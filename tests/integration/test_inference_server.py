"""The real inference server (``python -m workers.inference``) in a subprocess, driven
through the orchestrator's InferenceClient: readiness, generation against a local
reference, auth, input validation, weight updates (corrupt refused, good applied) while a
request is paused in place, and clean exits on SIGTERM and /shutdown.
"""
from __future__ import annotations

import asyncio
import math
import signal
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch

from workers.common.inference_client import InferenceClient, InferenceError, wait_until_ready
from workers.common.protocol import PeerTimeout
from workers.models.tiny_moe.model import TinyMoeConfig, build_model
from workers.weights.filesystem.publisher import publish_step
from tests.helpers.netutil import free_port
from tests.integration.conftest import TOKEN, SERVER_MODEL as MODEL, INIT_SEED, start_server

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    proc, url, paths = start_server(run_dir)
    # Published after the server started: it must wait for step 0, not fail.
    model = build_model(TinyMoeConfig(**MODEL), seed=INIT_SEED)
    publish_step(paths.root / "weights", 0, model.state_dict(), keep_last=5)
    yield url, paths, model, proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)


def arun(fn):
    async def main():
        async with aiohttp.ClientSession() as session:
            return await fn(session)
    return asyncio.run(main())


@torch.no_grad()
def reference_greedy(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_ready_info_and_generate_match_reference(server):
    url, paths, model, _ = server

    async def body(session):
        client = InferenceClient(url, TOKEN, session=session, timeout_s=30)
        await wait_until_ready([client], deadline_s=60)
        assert await client.health()
        info = await client.get_model_info()
        assert (info["num_layers"], info["top_k"], info["num_experts"], info["vocab_size"]) == (2, 2, 8, 16)
        assert info["weight_version"] == "0"
        prompts = [[1, 2, 3, 4, 5, 6], [7, 8], [3, 3, 3, 1]]
        results = await asyncio.gather(*(client.generate(p, temperature=0.0, max_new_tokens=6,
                                                         return_routed_experts=True) for p in prompts))
        for p, r in zip(prompts, results):
            assert r.output_ids == reference_greedy(model, p, 6)
            assert r.finish_reason == "length" and r.token_versions == [0] * 6 and r.weight_version == 0
            with torch.no_grad():
                full = model(torch.tensor([p + r.output_ids]))
            lps = torch.log_softmax(full.logits[0, len(p) - 1:-1], -1).gather(1, torch.tensor(r.output_ids)[:, None])
            assert np.allclose(r.output_logprobs, lps.squeeze(1).numpy(), atol=1e-4)
            assert r.routed_experts.dtype == np.uint8 and r.routed_experts.shape == (len(p) + 5, 2, 2)
            assert np.array_equal(r.routed_experts, full.routed_experts[0, :-1].numpy())
        stop = await client.generate([1, 2, 3, 4, 5, 6], temperature=0.0, max_new_tokens=6,
                                     stop_token_ids=[results[0].output_ids[0]])
        assert stop.output_ids == results[0].output_ids[:1] and stop.finish_detail["matched"] == stop.output_ids[0]
        # A batch of prompts answers a list, SGLang style.
        async with session.post(url + "/generate", json={"input_ids": prompts, "sampling_params": {
                "temperature": 1.0, "max_new_tokens": 3}, "return_logprob": True}) as resp:
            batch = await resp.json()
        assert resp.status == 200 and [len(b["output_ids"]) for b in batch] == [3, 3, 3]
        assert all(len(b["meta_info"]["output_token_logprobs"]) == 3 for b in batch)
        async with session.get(url + "/server_info") as resp:
            assert resp.status == 200 and (await resp.json())["num_generated_tokens"] >= 27
    arun(body)


def test_admin_routes_require_the_token(server):
    url = server[0]

    async def body(session):
        bad = InferenceClient(url, "wrong", session=session, timeout_s=10)
        for call in (bad.pause_generation(), bad.continue_generation(), bad.flush_cache(),
                     bad.update_weights_from_disk("/nowhere", 1), bad.update_weight_version(3)):
            with pytest.raises(InferenceError) as e:
                await call
            assert e.value.status == 401 and "admin route" in e.value.text
        async with session.post(url + "/shutdown") as resp:
            assert resp.status == 401
        assert await bad.health()  # read-only routes stay open
    arun(body)


BAD = [
    (b"{not json", "body"),
    ({"input_ids": "1 2 3"}, "input_ids"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, 99]}, "input_ids[1]"),
    ({"input_ids": [1, True]}, "input_ids[1]"),
    ({"input_ids": [[1], [2, "x"]]}, "input_ids[1][1]"),
    ({"input_ids": [1] * 512}, "max_position_embeddings"),
    ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0.0}}, "sampling_params.top_p"),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": [40]}}, "stop_token_ids"),
    ({"input_ids": [1], "text": "hi"}, "text"),
    ({"input_ids": [1], "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),  # unknown top-level keys: ignored
    ({"input_ids": [[1], [2]], "rid": "one"}, "rid"),
]


def test_malformed_requests_get_400_naming_the_field(server):
    url = server[0]

    async def body(session):
        for payload, field in BAD:
            data = payload if isinstance(payload, bytes) else None
            async with session.post(url + "/generate", data=data, json=None if data else payload) as resp:
                text = await resp.text()
                assert resp.status == 400, (payload, text)
                assert field in text, (field, text)
        async with session.post(url + "/update_weights_from_disk", json={"model_path": "/x", "weight_version": "abc"},
                                headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            assert resp.status == 400 and "weight_version" in await resp.text()
        async with session.post(url + "/generate", data=b"[" + b"1," * (5 << 20) + b"1]") as resp:
            assert resp.status == 413
        client = InferenceClient(url, TOKEN, session=session, timeout_s=10)
        await client.health_generate()  # still serving
    arun(body)


def test_weight_updates_while_paused_in_place(server):
    url, paths, model, _ = server
    root = paths.root / "weights"
    publish_step(root, 1, {k: v * 1.5 for k, v in model.state_dict().items()}, keep_last=5)
    shard = root / "step_000001" / "model.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-4] ^= 0xFF
    shard.write_bytes(bytes(raw))
    zero_head = {k: v.clone() for k, v in model.state_dict().items()}
    zero_head["lm_head.weight"].zero_()  # all logits equal: greedy emits token 0
    publish_step(root, 2, zero_head, keep_last=5)

    async def body(session):
        client = InferenceClient(url, TOKEN, session=session, timeout_s=60)
        base = (await client.server_info())["num_generated_tokens"]
        tasks = [asyncio.create_task(client.generate([i + 1], temperature=0.0, max_new_tokens=480)) for i in range(8)]
        deadline = time.monotonic() + 20
        while (await client.server_info())["num_generated_tokens"] < base + 400:  # all 8 are decoding by now
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        paused = await client.pause_generation("in_place")
        assert paused["num_paused_requests"] >= 1
        with pytest.raises(InferenceError) as e:
            await client.update_weights_from_disk(str(root / "step_000001"), 1)
        assert e.value.status == 400 and "checksum" in e.value.text
        assert (await client.get_model_info())["weight_version"] == "0"
        out = await client.update_weights_from_disk(str(root / "step_000002"), 2)
        assert out["success"] and out["num_paused_requests"] == paused["num_paused_requests"]
        assert set(out["update_timing"]) == {"read_s", "stage_s", "lock_wait_s", "swap_s", "total_s"}  # our extension
        await client.flush_cache()
        await client.continue_generation()
        results = await asyncio.gather(*tasks)
        crossed = [r for r in results if r.token_versions[0] == 0 and r.token_versions[-1] == 2]
        assert len(crossed) == paused["num_paused_requests"]
        for r in crossed:
            assert r.token_versions == sorted(r.token_versions) and r.weight_version == 2
            tail = [(t, lp) for t, lp, v in zip(r.output_ids, r.output_logprobs, r.token_versions) if v == 2]
            assert all(t == 0 and abs(lp + math.log(16)) < 1e-5 for t, lp in tail)
        fresh = await client.generate([5, 6], temperature=0.0, max_new_tokens=4)
        assert fresh.output_ids == [0] * 4 and fresh.token_versions == [2] * 4
        await client.update_weight_version(3)
        assert (await client.get_model_info())["weight_version"] == "3"
    arun(body)


def test_wait_until_ready_names_the_missing_worker(server):
    url, dead = server[0], f"http://127.0.0.1:{free_port()}"

    async def body(session):
        clients = [InferenceClient(u, TOKEN, session=session, timeout_s=5) for u in (url, dead)]
        with pytest.raises(PeerTimeout) as e:
            await wait_until_ready(clients, deadline_s=0.5, poll_s=0.1)
        assert dead in str(e.value) and "1/2" in str(e.value) and url + " " not in str(e.value)
    arun(body)


def test_sigterm_by_pid_exits_cleanly(server):
    url, paths, _, proc = server
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0
    log = (paths.root / "inference.log").read_text()
    assert f"inference[0] INFO serving on {url}" in log and "Traceback" not in log


def test_shutdown_route_exits_cleanly(tmp_path):
    proc, url, paths = start_server(tmp_path)
    model = build_model(TinyMoeConfig(**MODEL), seed=INIT_SEED)
    publish_step(paths.root / "weights", 0, model.state_dict(), keep_last=2)

    async def body(session):
        await wait_until_ready([InferenceClient(url, TOKEN, session=session, timeout_s=10)], deadline_s=60)
        async with session.post(url + "/shutdown", headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            assert resp.status == 200
    try:
        arun(body)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in (tmp_path / "inference.log").read_text()
