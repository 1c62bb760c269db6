"""Two real embedded servers behind SGLang's own router (smg, pinned in setup.cfg [sglang]), its
command line built by workers/inference/sglang/router.py: generation with token ids and SGLang's
fields (logprobs, routed experts, weight version) answers as the servers do directly, through the
orchestrator's own client too; health and model info pass through; one routing key stays on one
server (consistent_hashing) while different keys reach both. smg forwards fields of its own in the
body (``background``), which the embedded server ignores as SGLang does."""
from __future__ import annotations

import asyncio
import importlib.metadata
import signal
import subprocess
import sys
import time

import aiohttp
import pytest

from tests.conftest import REPO, compose
from tests.integration.conftest import INIT_SEED, SERVER_MODEL, TOKEN, start_server
from tests.helpers.netutil import free_port
from workers.common.inference_client import InferenceClient, wait_until_ready
from workers.inference.sglang.router import router_argv
from workers.models.tiny_moe.model import TinyMoeConfig, build_model
from workers.weights.filesystem.publisher import publish_step

pytest.importorskip("smg.launch_router")
GREEDY = {"temperature": 0.0, "max_new_tokens": 4}


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    servers, urls = [], []
    weights = build_model(TinyMoeConfig(**SERVER_MODEL), seed=INIT_SEED).state_dict()
    try:
        for i in range(2):
            proc, url, paths = start_server(tmp_path_factory.mktemp(f"server{i}"))
            publish_step(paths.root / "weights", 0, weights, keep_last=5)
            servers.append(proc)
            urls.append(url)
        asyncio.run(_ready(urls))
        cfg = compose(["inference=sglang", "cluster=h200_ib"])
        r = cfg.inference.sglang.router
        r.worker_startup_timeout_s, r.health_check_interval_s, r.log_level = 60, 5, "warn"
        r.extra_args = ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # not 0.0.0.0:29000
        port = free_port()
        argv = router_argv(cfg, host="127.0.0.1", port=port, inference_urls=tuple(urls), prefill_urls=(),
                           decode_urls=(), python=sys.executable)  # no key: production adds it via keyed.py
        log_path = tmp_path_factory.mktemp("router") / "router.log"
        with open(log_path, "w") as log:
            router = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        servers.append(router)
        router_url = f"http://127.0.0.1:{port}"
        asyncio.run(_router_ready(router_url, router, log_path))
        yield router_url, urls, cfg
    finally:
        for p in reversed(servers):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


async def _ready(urls):
    async with aiohttp.ClientSession() as s:
        await wait_until_ready([InferenceClient(u, TOKEN, session=s, timeout_s=10) for u in urls], 120)


async def _router_ready(url, proc, log_path, timeout_s=90):
    """smg registers the servers in the background: ready once /workers lists both healthy."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"smg exited {proc.returncode}:\n{log_path.read_text()[-3000:]}"
            try:
                async with s.get(url + "/workers") as r:
                    workers = (await r.json()).get("workers", [])
                if len(workers) == 2 and all(w.get("is_healthy") for w in workers):
                    return
            except (aiohttp.ClientError, ValueError):
                pass
            await asyncio.sleep(0.5)
    raise AssertionError(f"smg did not register both servers in {timeout_s}s:\n{log_path.read_text()[-3000:]}")


def _arun(fn):
    async def main():
        async with aiohttp.ClientSession() as session:
            return await fn(session)
    return asyncio.run(main())


async def _generated(session, url) -> int:
    async with session.get(url + "/server_info") as r:
        return (await r.json())["num_generated_tokens"]


def test_generate_health_and_model_info_through_smg(routed):
    router_url, urls, _ = routed

    async def body(session):
        async with session.get(router_url + "/health") as r:
            assert r.status == 200
        async with session.get(router_url + "/get_model_info") as r:
            info = await r.json()
        assert r.status == 200 and info["served_model_name"] == "tiny_moe" and info["num_experts"] == 8, info
        async with session.get(router_url + "/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"]] == ["tiny_moe"]
        req = {"input_ids": [1, 2, 3], "sampling_params": GREEDY, "return_logprob": True, "return_routed_experts": True}
        async with session.post(router_url + "/generate", json=req) as r:
            assert r.status == 200, await r.text()
            via_router = await r.json()
        async with session.post(urls[0] + "/generate", json=req) as r:
            direct = await r.json()
        assert via_router["output_ids"] == direct["output_ids"] and len(via_router["output_ids"]) == 4
        meta = via_router["meta_info"]
        assert meta["finish_reason"]["type"] == "length" and meta["weight_version"] == "0"
        assert [t for _, t, _ in meta["output_token_logprobs"]] == via_router["output_ids"]
        assert meta["routed_experts"] == direct["meta_info"]["routed_experts"]
        client = InferenceClient(router_url, TOKEN, session=session, timeout_s=30, num_layers=2, top_k=2, num_experts=8)
        res = await client.generate([1, 2, 3], return_routed_experts=True, **GREEDY)  # the orchestrator's client
        assert res.output_ids == direct["output_ids"] and res.routed_experts.shape == (3 + 4 - 1, 2, 2)
        async with session.post(router_url + "/generate", json={"input_ids": [1], "sampling_params": {"min_p": 0.5}}) as r:
            assert r.status == 400 and "sampling_params.min_p" in await r.text()  # the server's 400 passes through
    _arun(body)


def test_routing_key_sticks_to_one_server_and_keys_spread(routed):
    router_url, urls, cfg = routed
    header = cfg.inference.sglang.router.routing_key_header

    async def gen(session, key):
        async with session.post(router_url + "/generate", headers={header: key},
                                json={"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}}) as r:
            assert r.status == 200, await r.text()

    async def body(session):
        before = [await _generated(session, u) for u in urls]
        for _ in range(4):
            await gen(session, "episode-7")
        after = [await _generated(session, u) for u in urls]
        assert sorted(a - b for a, b in zip(after, before)) == [0, 8], (before, after)  # one server took all 4
        for k in range(16):
            await gen(session, f"episode-{k}")
        spread = [await _generated(session, u) - a for u, a in zip(urls, after)]
        assert all(n > 0 for n in spread), spread
    _arun(body)


def test_the_router_under_test_is_the_pinned_smg():
    """smg's own smg/version.py says 1.1.0 in the 1.13.0 wheel: the installed distribution is the truth."""
    pin = next(line.split("==")[1].strip() for line in (REPO / "setup.cfg").read_text().splitlines()
               if line.strip().startswith("smg=="))
    assert importlib.metadata.version("smg") == pin
