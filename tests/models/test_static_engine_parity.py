"""The static engine (fixed KV slots, chunked prefill: workers/inference/embedded/static_engine.py)
generates exactly transformers' greedy tokens and the dynamic engine's, per family.

Covers the two cache layouts the static cache holds: GQA keys/values (llama with tied
embeddings, qwen3_moe with q/k norms and head_dim != hidden/heads) and DeepSeek's MLA latent
(deepseek_v3 with YaRN and interleaved rotary), the DSA indexer's keys beside it (glm_moe_dsa)
and Mamba-2's per-slot recurrent state (nemotron_h, a hybrid of Mamba-2, attention, MLP and
LatentMoE layers). Small slots (``max_batch_size`` 2 for 3-4
prompts: a slot is reused), a prefill chunk shorter than the prompts and a host sync every 3
steps, so each run crosses chunk, slot-reuse and block boundaries.
"""
from __future__ import annotations

import functools
import logging

import pytest
import torch

from tests.models.parity import assert_engine_greedy_matches_hf, hf_reference, load_into
from tests.models.test_parity_deepseek_v3 import BASE as DSV3, YARN, hf_model, ours_from
from workers.common.registry import MODELS
from workers.inference.embedded.static_engine import StaticEngine, create_engine
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


def test_nemotron_h_mamba2_state_in_slots(tmp_path):
    """Mamba-2 layers keep (conv window, SSM state) per slot: a prompt of 7 over chunks of 3
    beside shorter right-padded rows, slot reuse (state zeroed at admission), rows idling
    mid-block (state frozen), plus attention, MLP and LatentMoE layers (routing records)."""
    from tests.models.test_parity_nemotron_h import pair

    ours, hf, _ = pair(tmp_path)
    _check(ours, hf)


def test_rows_that_are_not_live_keep_their_mamba2_state(tmp_path):
    """A CUDA graph's warm-up runs the decode step with every slot inactive (cuda_graphs.py): for
    positional keys that is harmless, for a recurrent state only if the step leaves it alone. On
    CPU no graph is captured, so the step is run here the way capture runs it."""
    from tests.models.test_parity_nemotron_h import pair
    from workers.inference.embedded.requests import _Seq

    ours, _, _ = pair(tmp_path)
    engine = STATIC(ours, max_batch_size=2, seed=0)
    seqs = [_Seq(GenRequest(input_ids=p, max_new_tokens=5, temperature=0.0), lambda out: None) for p in PROMPTS[:2]]
    for slot, s in enumerate(seqs):
        s.slot = slot
    with torch.inference_mode():
        engine._prefill(seqs)
        before = [tuple(t.clone() for t in st) for st in engine.slots.states if st]
        with engine._quiesced():
            engine._decode_step(2, 16, False)
        after = [st for st in engine.slots.states if st]
        assert all(torch.equal(a, b) for x, y in zip(before, after) for a, b in zip(x, y))
        engine._decode_step(2, 16, False)  # live rows do advance
        assert not all(torch.equal(a, b) for x, y in zip(before, after) for a, b in zip(x, y))


def test_latent_moe_grouped_and_dense_sums_are_the_expert_loop(monkeypatch):
    """LatentMoE's capture-safe paths: bf16 grouped GEMM over its squared-ReLU expert stacks (the
    parameters themselves, updated in place through the per-expert state-dict views: what captured
    graphs read), and the
    float32 dense sum (every expert on every token). Both equal the reference loop up to rounding."""
    import workers.models.blocks.kernels as kernels
    from workers.models.blocks.latent_moe import LatentMoE

    torch.manual_seed(0)
    moe = LatentMoE(hidden_size=16, num_experts=6, top_k=2, expert_intermediate_size=16, shared_intermediate_size=8,
                    latent_size=8, n_group=2, topk_group=1)
    flat = torch.randn(10, 8)
    idx = torch.stack([torch.randperm(6)[:2] for _ in range(10)])
    weights = torch.rand(10, 2)
    loop, dense = moe._experts(flat, idx, weights), moe._experts_dense(flat, idx, weights)
    assert loop.abs().max() > 0 and torch.allclose(loop, dense, atol=1e-6)

    moe, flat = moe.to(torch.bfloat16), flat.to(torch.bfloat16)
    loop = moe._experts(flat, idx, weights).float()
    monkeypatch.setattr(kernels, "FAST_PATH_ON_CPU", True)
    with torch.inference_mode():
        grouped = moe._experts(flat, idx, weights).float()
        assert (grouped - loop).abs().max() <= 0.02 * loop.abs().max()
        stack = moe.experts.up_proj.data_ptr()  # the tensor a captured graph reads
        with torch.no_grad():
            for name, w in moe.experts.state_dict().items():  # per-expert views, as the engine's loader writes
                if name.endswith("up_proj.weight"):
                    w.mul_(2)
        assert moe.experts.up_proj.data_ptr() == stack  # same tensor, new values
        doubled = moe._experts(flat, idx, weights).float()
    monkeypatch.setattr(kernels, "FAST_PATH_ON_CPU", False)
    ref = moe._experts(flat, idx, weights).float()  # relu(2u)^2 = 4 relu(u)^2
    assert (doubled - ref).abs().max() <= 0.02 * ref.abs().max() and ref.abs().max() > 3 * loop.abs().max()


@pytest.mark.parametrize("variant", ["every_layer_full_plain_rope", "shared_layer_yarn"])
def test_glm_moe_dsa_index_keys_in_slots(variant, tmp_path):
    """The DSA indexer's keys sit in slots beside the MLA latent; index_topk (4) is below every
    sequence's length, so the choice of keys (and a shared layer's reuse of it) decides the tokens."""
    from tests.models.test_parity_glm_moe_dsa import GLM, VARIANTS

    hf, d = hf_model({**GLM, **VARIANTS[variant]}, tmp_path, family="glm_moe_dsa")
    ours, _ = ours_from(hf, d, family="glm_moe_dsa")
    _check(ours, hf)


def test_every_builtin_family_gets_the_static_engine(caplog):
    """No fallback any more: on ``static_cache=on`` the factory builds the static engine for the
    recurrent and DSA families too, without the fallback's warning."""
    from transformers import GlmMoeDsaConfig, NemotronHConfig as HfNemotron

    from tests.models.test_parity_glm_moe_dsa import GLM
    from tests.models.test_parity_nemotron_h import HF_KW

    with caplog.at_level(logging.WARNING, logger="slurmrl.inference"):
        for family, hf_cfg in (("nemotron_h", HfNemotron(**HF_KW)), ("glm_moe_dsa", GlmMoeDsaConfig(**GLM))):
            spec = MODELS.get(family)
            m = spec.build(spec.config(name="t", **spec.from_hf_config(hf_cfg.to_dict())), dtype=torch.float32)
            assert unsupported_reason(m) is None
            engine = create_engine(m, max_batch_size=2, seed=0,
                                   options=type("O", (), {"static_cache": "on", "max_seq_len": 32})())
            assert type(engine) is StaticEngine
    assert "dynamic engine" not in caplog.text
