"""The static engine (fixed KV slots, chunked prefill: workers/inference/embedded/decode_loop.py)
generates exactly transformers' greedy tokens and the dynamic engine's, per family.

Covers the two cache layouts the static cache holds: GQA keys/values (llama with tied
embeddings, qwen3_moe with q/k norms and head_dim != hidden/heads) and DeepSeek's MLA latent
(deepseek_v3 with YaRN and interleaved rotary). Small slots (``max_batch_size`` 2 for 3-4
prompts: a slot is reused), a prefill chunk shorter than the prompts and a host sync every 3
steps, so each run crosses chunk, slot-reuse and block boundaries. Families the static cache does
not hold (Mamba-2 state, DSA index keys) fall back to the dynamic engine, with a log line.
"""
from __future__ import annotations

import functools
import logging

import pytest
import torch

from tests.models.parity import assert_engine_greedy_matches_hf, hf_reference, load_into
from tests.models.test_parity_deepseek_v3 import BASE as DSV3, YARN, hf_model, ours_from
from workers.common.registry import MODELS
from workers.inference.embedded.decode_loop import StaticEngine, create_engine
from workers.inference.embedded.engine import GenRequest, InferenceEngine
from workers.inference.embedded.static_cache import unsupported_reason

PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [9, 8, 7, 6, 5]]
STATIC = functools.partial(StaticEngine, max_seq_len=40, prefill_chunk=3, sync_every=3, smallest_key_window=8)


def _tokens(engine, prompts, n=7):
    engine.start()
    try:
        outs = engine.generate([GenRequest(rid=str(i), input_ids=p, max_new_tokens=n, temperature=0.0,
                                           return_routed_experts=True) for i, p in enumerate(prompts)])
    finally:
        engine.shutdown()
    return outs


def _check(ours, hf):
    assert unsupported_reason(ours) is None
    assert_engine_greedy_matches_hf(ours, hf, PROMPTS, max_new_tokens=7, make_engine=STATIC)
    dyn = _tokens(InferenceEngine(ours, max_batch_size=2, seed=0), PROMPTS)
    sta = _tokens(STATIC(ours, max_batch_size=2, seed=0), PROMPTS)
    for a, b in zip(dyn, sta):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
        assert torch.equal(a.routed_experts, b.routed_experts)  # the Router Replay record, prompt included


def test_llama_gqa_tied(tmp_path):
    from transformers import LlamaConfig as HfLlamaConfig

    spec = MODELS.get("llama")
    cfg = spec.config(name="t", vocab_size=80, hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                      dense_intermediate_size=64, tie_word_embeddings=True, max_position_embeddings=64,
                      rope_theta=10000.0, rms_norm_eps=1e-6)
    hf, d = hf_reference(HfLlamaConfig(**spec.to_hf_config(cfg)), tmp_path)
    _check(load_into(spec.build(cfg, dtype=torch.float32), d), hf)


def test_qwen3_moe_gqa_qk_norm(tmp_path):
    from tests.models.test_parity_qwen3_moe import BASE, _hf_config

    hf, d = hf_reference(_hf_config(BASE), tmp_path)
    _check(load_into(MODELS.get("qwen3_moe").build(BASE, dtype=torch.float32), d), hf)


def test_deepseek_v3_mla_latent_cache(tmp_path):
    hf, d = hf_model({**DSV3, "rope_parameters": YARN, "max_position_embeddings": 16384}, tmp_path)
    ours, _ = ours_from(hf, d)
    _check(ours, hf)


def test_recurrent_and_dsa_families_fall_back_to_the_dynamic_engine(caplog):
    from transformers import GlmMoeDsaConfig, NemotronHConfig as HfNemotron

    from tests.models.test_parity_glm_moe_dsa import GLM
    from tests.models.test_parity_nemotron_h import HF_KW

    models = []
    for family, hf_cfg in (("nemotron_h", HfNemotron(**HF_KW)), ("glm_moe_dsa", GlmMoeDsaConfig(**GLM))):
        spec = MODELS.get(family)
        models.append(spec.build(spec.config(name="t", **spec.from_hf_config(hf_cfg.to_dict())), dtype=torch.float32))
    assert "recurrent" in unsupported_reason(models[0]) and "DSA" in unsupported_reason(models[1])
    with caplog.at_level(logging.WARNING, logger="slurmrl.inference"):
        for m in models:
            engine = create_engine(m, max_batch_size=2, seed=0, options=type("O", (), {"static_cache": "on"})())
            assert type(engine) is InferenceEngine
    assert caplog.text.count("using the dynamic engine") == 2
    with pytest.raises(ValueError, match="static KV cache"):
        StaticEngine(models[0], max_batch_size=2, seed=0)
