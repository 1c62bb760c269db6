"""The embedded server accepts the /generate bodies SGLang accepts and refuses only what SGLang
refuses, or what it cannot honour without a silently different answer (each 400 names the field).
In-process: the real aiohttp app over a real engine with a tiny random model. The field tables
are checked against SGLang's own request contract (sglang.api.v1), which the server itself never
imports."""
from __future__ import annotations

import asyncio
import json

import torch

from tests.integration.conftest import with_embedded_app
from workers.inference.embedded import generate_request as gr
from workers.models.tiny_moe.config import TinyMoeConfig

torch.set_num_threads(1)
MODEL = TinyMoeConfig(name="tiny_moe", vocab_size=16, hidden_size=32, num_layers=1, num_heads=2, num_experts=4, top_k=2,
                      expert_intermediate_size=32, max_position_embeddings=64)
P = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}

ACCEPTED = [  # bodies SGLang's /generate admits; the engine answers them (unknown keys ignored)
    {**P, "background": False, "no_such_field": {"x": 1}},  # smg adds background; SGLang ignores unknown keys
    {**P, "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": 7, "routing_key": "ep-1", "priority": 3,
     "extra_key": "k", "cache_salt": ["s"], "custom_labels": {"team": "rl"}, "log_metrics": True,
     "return_text_in_logprobs": True, "require_reasoning": False, "return_prompt_token_ids": False, "rid": "r-1"},
    {**P, "text": None, "image_data": None, "lora_path": None, "return_hidden_states": False, "token_ids_logprob": None,
     "session_params": None, "input_embeds": None, "custom_logit_processor": None, "top_logprobs_num": 0},
    {"input_ids": [1], "sampling_params": {"temperature": None, "max_new_tokens": 3, "top_p": None, "top_k": -1,
                                           "min_p": 0, "stop": [], "stop_regex": None, "json_schema": "",
                                           "logit_bias": {}, "n": 1, "beam_width": None, "sampling_seed": None,
                                           "ignore_eos": True, "skip_special_tokens": False, "no_stop_trim": True,
                                           "spaces_between_special_tokens": True, "stream_interval": 4,
                                           "custom_params": {"a": 1}, "watermark": None, "choice": [],
                                           "frequency_penalty": 0.0, "presence_penalty": 0, "repetition_penalty": 1}},
    {"input_ids": [1], "sampling_params": {"top_k": 1 << 30, "max_new_tokens": None}},  # SGLang's "all" and "no limit"
    {"input_ids": [[1, 2], [3]], "sampling_params": [{"max_new_tokens": 1}, None], "return_logprob": [True, False],
     "logprob_start_len": [-1, 0], "top_logprobs_num": [0, 0]},
]
REFUSED = [  # (body, field named): SGLang refuses these too, or the answer would silently differ
    ({**P, "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p"),  # SGLang: (0, 1]
    ({**P, "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),  # SGLang: -1 or >= 1
    ({**P, "sampling_params": {"min_p": 2}}, "sampling_params.min_p"),
    ({**P, "sampling_params": {"repetition_penalty": 0}}, "sampling_params.repetition_penalty"),
    ({**P, "sampling_params": {"frequency_penalty": 3}}, "sampling_params.frequency_penalty"),
    ({**P, "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({**P, "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ({**P, "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ({**P, "sampling_params": {"colour": 1}}, "sampling_params.colour"),  # SGLang rejects unknown sampling keys
    ({**P, "sampling_params": {"ignore_eos": "yes"}}, "sampling_params.ignore_eos"),
    ({**P, "priority": "high"}, "priority"), ({**P, "custom_labels": ["x"]}, "custom_labels"),
    ({**P, "stream": "yes"}, "stream"), ({"input_ids": [[1], [2]], "return_logprob": [True]}, "return_logprob"),
    # accepted by SGLang, but the engine cannot honour them: refused rather than ignored
    ({**P, "sampling_params": {"min_p": 0.5}}, "sampling_params.min_p"),
    ({**P, "sampling_params": {"stop": ["\n"]}}, "sampling_params.stop"),
    ({**P, "sampling_params": {"regex": "[0-9]+"}}, "sampling_params.regex"),
    ({**P, "sampling_params": {"n": 2}}, "sampling_params.n"),
    ({**P, "sampling_params": {"logit_bias": {"3": 5.0}}}, "sampling_params.logit_bias"),
    ({"text": "hi"}, "text"), ({**P, "image_data": "x.png"}, "image_data"), ({**P, "lora_path": "a"}, "lora_path"),
    ({**P, "return_hidden_states": True}, "return_hidden_states"), ({**P, "top_logprobs_num": 2}, "top_logprobs_num"),
    ({**P, "token_ids_logprob": [1]}, "token_ids_logprob"), ({**P, "session_params": {"id": "s"}}, "session_params"),
]


def test_every_sglang_contract_field_is_known():
    """Drift guard: each field of SGLang's GenerateRequest is used, ignored or refused by name,
    and each SamplingParams key is handled (none falls to 'unknown sampling parameter')."""
    from sglang.api.v1 import api_types as api  # `make install-sglang` (part of `make test`) pins it

    used = {"input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num", "rid", "stream",
            "routed_experts_start_len"}
    missing = set(api.GenerateRequest.__struct_fields__) - used - set(gr.IGNORED) - set(gr.REFUSED)
    assert not missing, missing
    for key in api.SamplingParams.__struct_fields__:
        try:
            gr.parse_sampling({key: None}, "sp", 16, 64)
        except gr.BadRequest as e:
            assert "unknown" not in str(e), (key, e)


def test_accepts_what_sglang_accepts_and_refuses_naming_the_field():
    async def run(session, base):
        for body in ACCEPTED:
            async with session.post(base + "/generate", json=body) as r:
                assert r.status == 200, (body, await r.text())
                out = await r.json()
            outs = out if isinstance(body["input_ids"][0], list) else [out]
            assert all(o["output_ids"] and o["meta_info"]["finish_reason"] for o in outs), out
        batch = outs  # the last body: per-prompt return_logprob
        assert "output_token_logprobs" in batch[0]["meta_info"] and "output_token_logprobs" not in batch[1]["meta_info"]
        for body, field in REFUSED:
            async with session.post(base + "/generate", json=body) as r:
                text = await r.text()
            assert r.status == 400 and field in json.loads(text)["error"]["message"], (body, r.status, text)
    asyncio.run(with_embedded_app(MODEL, run))


def test_stream_true_answers_server_sent_events():
    async def run(session, base):
        async with session.post(base + "/generate", json={**P, "stream": True, "return_logprob": True}) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            events = [line[len("data: "):] for line in (await r.text()).split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) == 2
        out = json.loads(events[0])
        assert len(out["output_ids"]) == 2 and len(out["meta_info"]["output_token_logprobs"]) == 2
        async with session.post(base + "/generate", json={"input_ids": [[1], [2]], "stream": True}) as r:
            events = [e for e in (await r.text()).split("\n\n") if e.startswith("data: {")]
        assert sorted(json.loads(e[6:])["index"] for e in events) == [0, 1]
    asyncio.run(with_embedded_app(MODEL, run))


def test_top_p_reaches_the_sampler_per_request():
    """top_p goes through to sampling, per prompt of a batch: a vanishing nucleus at temperature 1
    answers exactly what greedy answers, while top_p 1 at temperature 1 samples."""
    assert gr.parse_sampling({"top_p": 0.5}, "sp", 16, 64)["top_p"] == 0.5

    async def run(session, base):
        hot = {"temperature": 1.0, "max_new_tokens": 12}
        body = {"input_ids": [[1, 2, 3]] * 3,
                "sampling_params": [{**hot, "top_p": 1e-6}, {**hot, "temperature": 0.0}, {**hot, "top_p": 1.0}]}
        async with session.post(base + "/generate", json=body) as r:
            assert r.status == 200, await r.text()
            nucleus, greedy, full = [o["output_ids"] for o in await r.json()]
        assert nucleus == greedy and full != greedy
    asyncio.run(with_embedded_app(MODEL, run))
