"""Router Replay through prefill/decode disaggregation, against fake SGLang servers in PD mode.

Two prefill and two decode fakes (tests/fakes/fake_sglang.py, ``disaggregation_mode``) report
routing as the pinned PD path does: prefill the prompt's rows, decode stale rows for prompt
positions it never ran. The orchestrator's pair client (workers/inference/sglang/pd_client.py)
must return, per position, exactly what one unified server returns for the same request: for a
first turn, for a multi-turn continuation (earlier completion tokens now in the prompt), and for
every prompt group (different pairs). Routing missing on one side marks the sample instead.
"""
from __future__ import annotations

import asyncio
import contextlib
import types

import aiohttp
import numpy as np

from tests.fakes.fake_sglang import FakeSGLangConfig, serve_fake_sglang
from workers.common.inference_client import InferenceClient
from workers.inference.sglang.pd_client import PDPairs

SHAPE = dict(vocab_size=50, num_layers=3, top_k=2, num_experts=8)


async def run(prefill_reports: bool = True):
    async with contextlib.AsyncExitStack() as stack:
        def serve(mode: str, routed: bool = True):
            return stack.enter_async_context(serve_fake_sglang(FakeSGLangConfig(
                **SHAPE, enable_return_routed_experts=routed, disaggregation_mode=mode)))
        unified = await serve("null")
        prefill = [await serve("prefill", prefill_reports) for _ in range(2)]
        decode = [await serve("decode") for _ in range(2)]
        session = await stack.enter_async_context(aiohttp.ClientSession())
        shape = (SHAPE["num_layers"], SHAPE["top_k"], SHAPE["num_experts"])
        urls = tuple(u for u, _ in prefill + decode)
        topo = types.SimpleNamespace(prefill_urls=urls[:2], decode_urls=urls[2:], inference_urls=urls)
        pairs = PDPairs(types.SimpleNamespace(experiment="exp"), topo, "tok", session=session, timeout_s=30,
                        shape=shape, health=None)
        single = InferenceClient(unified[0], "tok", session=session, timeout_s=30, num_layers=shape[0],
                                 top_k=shape[1], num_experts=shape[2])
        out = []
        for gid in range(6):  # several groups: several pairs
            client = pairs.for_group(gid)
            prompt = [1 + gid, 2, 3, 4, 5]
            for _turn in range(2):  # a multi-turn continuation re-sends the whole history
                kw = dict(temperature=1.0, max_new_tokens=4, return_routed_experts=True)
                got, want = await asyncio.gather(client.generate(prompt, **kw), single.generate(prompt, **kw))
                out.append((client, prompt, got, want))
                prompt = prompt + got.output_ids + [7, 8]
        return out, [f for _, f in prefill], [f for _, f in decode]


def test_merged_routing_equals_a_single_server_per_position():
    out, prefill, decode = asyncio.run(run())
    for client, prompt, got, want in out:
        assert got.output_ids == want.output_ids and got.output_logprobs == want.output_logprobs
        assert got.routed_experts.shape == (len(prompt) + len(got.output_ids) - 1, 3, 2)
        np.testing.assert_array_equal(got.routed_experts, want.routed_experts)
    assert len({c.prefill.base_url for c, *_ in out}) == 2 and len({c.decode.base_url for c, *_ in out}) == 2
    # each request went to its pair with one bootstrap room; decode asked only for the rows it ran
    gens = [r["body"] for f in prefill + decode for r in f.requests if r["path"] == "/generate"]
    assert len(gens) == 2 * len(out) and all(g["bootstrap_room"] is not None for g in gens)
    rooms = [g["bootstrap_room"] for g in gens]
    assert all(rooms.count(r) == 2 for r in rooms)  # the same room to prefill and decode, a new one per request
    dec = [r["body"] for f in decode for r in f.requests if r["path"] == "/generate"]
    assert all(d["routed_experts_start_len"] == len(d["input_ids"]) for d in dec)


def test_the_decode_servers_own_prompt_rows_are_stale():
    """Why the merge matters: taken whole, the decode server's answer would be wrong for the prompt."""
    from tests.fakes.fake_sglang import expected_routing, stale_routing

    rows = expected_routing(9, 0, 3, 2, 8)
    assert not np.array_equal(stale_routing(rows, 0, 5, 8)[:5], rows[:5])


def test_routing_missing_on_prefill_marks_the_sample():
    out, _, _ = asyncio.run(run(prefill_reports=False))
    for client, _, got, _ in out:
        assert got.routed_experts is None and got.output_ids
    assert sum(c.unreported for c in {id(c): c for c, *_ in out}.values()) >= 1
