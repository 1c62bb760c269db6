"""qwen3_moe against transformers' Qwen3MoeForCausalLM on the same weights (tests/models/parity.py).

Tiny configs built with transformers' own Qwen3MoeConfig from our ``to_hf_config``, covering
what makes Qwen3-MoE differ from tiny_moe: head_dim != hidden/heads, GQA, per-head q/k norms,
norm_topk_prob on and off, dense layers by decoder_sparse_step=2 and by mlp_only_layers=[0].
Each: logits (with and without left padding), gradients by checkpoint name, Router Replay over
the routed layers only, greedy generation through our embedded engine, the config.json round
trip, and transformers loading a directory written from OUR model.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.models.parity import (assert_engine_greedy_matches_hf, assert_from_pretrained_loads, assert_grads_match,
                                 assert_logits_match, assert_router_replay, hf_reference, load_into)
from workers.common.registry import MODELS
from workers.models.qwen3_moe.config import Qwen3MoeConfig
from workers.models.qwen3_moe.model import Qwen3MoeForCausalLM

BASE = Qwen3MoeConfig(name="t", vocab_size=96, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=24,
                      num_experts=8, top_k=2, expert_intermediate_size=32, dense_intermediate_size=48,
                      rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=64)
CONFIGS = {
    "gqa-hd24-norm": BASE,
    "raw-probs-sparse-step2": dataclasses.replace(BASE, num_layers=3, norm_topk_prob=False, decoder_sparse_step=2),
    "mlp-only-0-mha-tied": dataclasses.replace(BASE, mlp_only_layers=[0], num_kv_heads=4, head_dim=16, top_k=3,
                                               tie_word_embeddings=True),
}
SPEC = MODELS.get("qwen3_moe")
IDS = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(0))
ERRORS: dict[str, dict[str, float]] = {}  # printed with -s: the measured parity errors


def _hf_config(cfg: Qwen3MoeConfig):
    from transformers import Qwen3MoeConfig as HfQwen3MoeConfig

    return HfQwen3MoeConfig(**SPEC.to_hf_config(cfg))


@pytest.fixture(params=sorted(CONFIGS), scope="module")
def pair(request, tmp_path_factory):
    cfg = CONFIGS[request.param]
    hf, d = hf_reference(_hf_config(cfg), tmp_path_factory.mktemp(request.param))
    return request.param, cfg, load_into(Qwen3MoeForCausalLM(cfg), d), hf


def test_layers_are_the_ones_transformers_builds(pair):
    name, cfg, ours, hf = pair
    hf_moe = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers]
    assert [layer.routed for layer in ours.model.layers] == hf_moe == [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
    assert ours.num_routed_layers == cfg.num_routed_layers == sum(hf_moe) > 0
    assert sum(p.numel() for p in ours.parameters()) == SPEC.params(cfg).total == sum(p.numel() for p in hf.parameters())


def test_logits_match_with_and_without_left_padding(pair):
    name, cfg, ours, hf = pair
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :4] = 0  # left padding, as the engine prefills
    ERRORS.setdefault(name, {})["logits"] = assert_logits_match(ours, hf, IDS)
    ERRORS[name]["logits_left_pad"] = assert_logits_match(ours, hf, IDS, attention_mask=mask)


def test_gradients_match(pair):
    name, cfg, ours, hf = pair
    ERRORS.setdefault(name, {})["grads"] = assert_grads_match(ours, hf, IDS)


def test_router_replay(pair):
    assert_router_replay(pair[2], IDS)


def test_engine_greedy_equals_transformers_generate(pair):
    name, cfg, ours, hf = pair
    assert_engine_greedy_matches_hf(ours, hf, [[1, 2, 3], [5, 6, 7, 8, 9], [4]])


def test_config_json_round_trip(pair):
    name, cfg, ours, hf = pair
    assert Qwen3MoeConfig(name=cfg.name, **SPEC.from_hf_config(SPEC.to_hf_config(cfg))) == cfg
    # what transformers itself writes (num_local_experts, rope_parameters, its own extra keys) reads back too
    assert Qwen3MoeConfig(name=cfg.name, **SPEC.from_hf_config(hf.config.to_dict())) == cfg


def test_transformers_loads_a_directory_written_from_our_model(pair, tmp_path):
    name, cfg, ours, hf = pair
    seeded = Qwen3MoeForCausalLM(cfg).init_weights(5).eval()
    ERRORS.setdefault(name, {})["from_pretrained"] = assert_from_pretrained_loads(
        seeded, SPEC.to_hf_config(cfg), tmp_path, IDS)
    print(f"\nqwen3_moe parity errors: {ERRORS}")


@pytest.mark.parametrize("key, value, why", [
    ("use_sliding_window", True, "use_sliding_window=True is not implemented"),
    ("attention_bias", True, "attention_bias=True is not implemented"),
    ("hidden_act", "gelu", "hidden_act='gelu' is not implemented"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling=.* is not implemented"),
    ("rope_parameters", {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}, "rope_parameters=.* is not implemented"),
    ("quantization_config", {"quant_method": "fp8"}, "key 'quantization_config'"),
    ("architectures", ["LlamaForCausalLM"], "is not qwen3_moe's"),
])
def test_config_json_keys_we_do_not_implement_are_refused(key, value, why):
    d = SPEC.to_hf_config(BASE)
    d[key] = value
    with pytest.raises(ValueError, match=why):
        SPEC.from_hf_config(d)


def test_an_absent_key_means_what_it_means_to_transformers():
    from transformers import Qwen3MoeConfig as HfQwen3MoeConfig

    sparse = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 96,
              "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    ours = Qwen3MoeConfig(name="t", **SPEC.from_hf_config(sparse))
    hf = HfQwen3MoeConfig(**sparse)
    assert (ours.kv_heads, ours.attention_head_dim, ours.num_experts, ours.top_k, ours.norm_topk_prob) == (
        hf.num_key_value_heads, hf.hidden_size // hf.num_attention_heads, hf.num_experts, hf.num_experts_per_tok,
        hf.norm_topk_prob)
    assert (ours.expert_intermediate_size, ours.dense_intermediate_size, ours.rope_theta) == (
        hf.moe_intermediate_size, hf.intermediate_size, hf.rope_parameters["rope_theta"])


def test_reference_weights_are_not_degenerate(pair):
    """Random routers and non-unit q/k norms: otherwise routing and the norms would go untested."""
    name, cfg, ours, hf = pair
    for layer in ours.model.layers:
        assert not torch.allclose(layer.self_attn.q_norm.weight, torch.ones(cfg.attention_head_dim))
        if layer.routed:
            assert layer.mlp.gate.weight.std() > 0


def test_qwen3_30b_a3b_preset_is_the_published_config():
    """transformers' own Qwen3MoeConfig built from to_hf_config of the composed preset has the
    values of Qwen/Qwen3-30B-A3B's config.json (public), and its parameter count is the published one."""
    from transformers import Qwen3MoeConfig as HfQwen3MoeConfig

    from tests.conftest import compose

    m = compose(["model=qwen3_30b_a3b"]).model
    hf = HfQwen3MoeConfig(**SPEC.to_hf_config(m))
    published = dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                     intermediate_size=6144, vocab_size=151936, rms_norm_eps=1e-6, max_position_embeddings=40960,
                     norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
                     attention_bias=False, use_sliding_window=False, hidden_act="silu")
    assert {k: getattr(hf, k) for k in published} == published
    assert hf.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
    assert hf.architectures == ["Qwen3MoeForCausalLM"] and hf.model_type == "qwen3_moe"
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        total = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf).parameters())
    assert total == SPEC.params(m).total == 30_532_122_624
