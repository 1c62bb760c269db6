"""gemma3_text against transformers' Gemma3ForCausalLM on the same weights (tests/models/parity.py).

Tiny configs built with transformers' own Gemma3TextConfig from our ``to_hf_config``, covering
what makes Gemma 3 differ from Llama: interleaved sliding-window (4 keys, shorter than every
sequence here) and full layers with their own rotary bases, head_dim != hidden/heads, GQA,
Gemma's (1 + w) q/k and sandwich norms, query_pre_attn_scalar != head_dim, the GELU-tanh MLP,
embeddings scaled by sqrt(hidden), tied and untied heads, linear rotary scaling of the full
layers. Each: logits (with and without left padding), gradients by checkpoint name, greedy
generation through the dynamic and the static embedded engine, the config.json round trip, and
transformers loading a directory written from OUR model.

Token ids avoid 0: Gemma's pad id, whose embedding row transformers' nn.Embedding(padding_idx=0)
never gives a lookup gradient (a pad token never reaches a loss in training here either).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.models.parity import (assert_engine_greedy_matches_hf, assert_from_pretrained_loads, assert_grads_match,
                                 assert_logits_match, hf_reference, load_into)
from tests.models.test_static_engine_parity import STATIC
from workers.common.registry import MODELS
from workers.models.gemma3_text.config import Gemma3TextConfig
from workers.models.gemma3_text.model import Gemma3ForCausalLM
from workers.models.layer_types import FULL, SLIDING

BASE = Gemma3TextConfig(name="t", vocab_size=96, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=24,
                        dense_intermediate_size=48, query_pre_attn_scalar=20, sliding_window=4,
                        layer_types=[SLIDING, FULL, SLIDING], rope_theta=1000.0, rope_local_base_freq=50.0,
                        rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=True)
CONFIGS = {
    "gqa-tied-window4": BASE,
    "mha-untied-linear-rope": dataclasses.replace(BASE, num_layers=2, num_kv_heads=4, head_dim=16, tie_word_embeddings=False,
                                                  layer_types=[FULL, SLIDING], rope_linear_factor=4.0, sliding_window=3),
}
SPEC = MODELS.get("gemma3_text")
IDS = torch.randint(1, 96, (2, 11), generator=torch.Generator().manual_seed(0))
ERRORS: dict[str, dict[str, float]] = {}  # printed with -s: the measured parity errors


GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
             "attention_dropout": 0.0, "attn_logit_softcapping": None, "bos_token_id": 2,
             "cache_implementation": "hybrid", "eos_token_id": [1, 106], "final_logit_softcapping": None,
             "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
             "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
             "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0,
             "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
             "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
             "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True,
             "vocab_size": 262144}
"""google/gemma-3-1b-it's config.json as published (transformers 4.50 keys)."""


def _hf_config(cfg: Gemma3TextConfig):
    from transformers import Gemma3TextConfig as HfGemma3TextConfig

    return HfGemma3TextConfig(**SPEC.to_hf_config(cfg))


def _random_norms(hf) -> None:
    """transformers initialises Gemma norms to 0 (the identity of (1 + w)): made random so each norm counts."""
    for name, p in hf.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(0.3 * torch.randn_like(p))


@pytest.fixture(params=sorted(CONFIGS), scope="module")
def pair(request, tmp_path_factory):
    cfg = CONFIGS[request.param]
    hf, d = hf_reference(_hf_config(cfg), tmp_path_factory.mktemp(request.param), prepare=_random_norms)
    return request.param, cfg, load_into(Gemma3ForCausalLM(cfg), d), hf


def test_layers_and_parameter_count_are_transformers(pair):
    name, cfg, ours, hf = pair
    assert [layer.self_attn.sliding_window for layer in ours.model.layers] == [
        cfg.sliding_window if t == SLIDING else None for t in hf.config.layer_types]
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


def test_engines_greedy_equal_transformers_generate(pair):
    """Prompts + 6 new tokens run past the 3-4 key window: the sliding layers' cache reads are exercised."""
    name, cfg, ours, hf = pair
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9], [4]]
    assert_engine_greedy_matches_hf(ours, hf, prompts)
    assert_engine_greedy_matches_hf(ours, hf, prompts, max_new_tokens=7, make_engine=STATIC)


def test_config_json_round_trip(pair):
    name, cfg, ours, hf = pair
    assert Gemma3TextConfig(name=cfg.name, **SPEC.from_hf_config(SPEC.to_hf_config(cfg))) == cfg
    # what transformers itself writes (rope_parameters per layer type, _sliding_window_pattern) reads back too
    assert Gemma3TextConfig(name=cfg.name, **SPEC.from_hf_config(hf.config.to_dict())) == cfg


def test_transformers_loads_a_directory_written_from_our_model(pair, tmp_path):
    name, cfg, ours, hf = pair
    seeded = Gemma3ForCausalLM(cfg).init_weights(5).eval()
    assert all(float(p.abs().max()) == 0 for n, p in seeded.named_parameters() if n.endswith("norm.weight"))
    with torch.no_grad():  # step 0's norms are the identity; random ones check that the offsets are saved as such
        for n, p in seeded.named_parameters():
            if n.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    ERRORS.setdefault(name, {})["from_pretrained"] = assert_from_pretrained_loads(
        seeded, SPEC.to_hf_config(cfg), tmp_path, IDS)
    print(f"\ngemma3_text parity errors: {ERRORS}")


def test_scaled_embedding_rounds_the_scale_like_transformers_in_bf16():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    from workers.models.gemma3_text.model import ScaledEmbedding

    ref = Gemma3TextScaledWordEmbedding(10, 3072, padding_idx=0, embed_scale=3072 ** 0.5).to(torch.bfloat16)
    ours = ScaledEmbedding(10, 3072, 3072 ** 0.5).to(torch.bfloat16)
    ours.weight.data.copy_(ref.weight.data)
    ids = torch.arange(1, 10)[None]
    assert torch.equal(ours(ids), ref(ids))  # sqrt(3072) = 55.43 is 55.5 in bf16, in both


@pytest.mark.parametrize("key, value, why", [
    ("final_logit_softcapping", 30.0, "final_logit_softcapping=30.0 is not implemented"),
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0 is not implemented"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention=True is not implemented"),
    ("hidden_activation", "gelu", "hidden_activation='gelu' is not implemented"),
    ("attention_bias", True, "attention_bias=True is not implemented"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_type='yarn' is not implemented"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4}, "keyed by"),
    ("quantization_config", {"quant_method": "fp8"}, "key 'quantization_config'"),
    ("architectures", ["Gemma3ForConditionalGeneration"], "is not gemma3_text's"),
])
def test_config_json_keys_we_do_not_implement_are_refused(key, value, why):
    d = SPEC.to_hf_config(BASE)
    d[key] = value
    with pytest.raises(ValueError, match=why):
        SPEC.from_hf_config(d)


def test_an_absent_key_means_what_it_means_to_transformers():
    """gemma-3-1b's config.json as published (transformers 4.50 keys: sliding_window_pattern,
    rope_local_base_freq, rope_scaling null) gives the fields transformers 5 derives from it."""
    from transformers import Gemma3TextConfig as HfGemma3TextConfig

    ours = Gemma3TextConfig(name="gemma-3-1b", **SPEC.from_hf_config(GEMMA3_1B))
    hf = HfGemma3TextConfig(**{k: v for k, v in GEMMA3_1B.items() if k != "torch_dtype"})
    assert ours.layer_types == hf.layer_types and ours.layer_types.count(FULL) == 4
    assert (ours.rope_theta, ours.rope_local_base_freq) == (hf.rope_parameters[FULL]["rope_theta"],
                                                            hf.rope_parameters[SLIDING]["rope_theta"])
    sparse = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 7}
    ours, hf = Gemma3TextConfig(name="t", **SPEC.from_hf_config(sparse)), HfGemma3TextConfig(num_hidden_layers=7)
    assert (ours.vocab_size, ours.kv_heads, ours.head_dim, ours.sliding_window, ours.query_pre_attn_scalar,
            ours.tie_word_embeddings, ours.layer_types) == (hf.vocab_size, hf.num_key_value_heads, hf.head_dim,
                                                            hf.sliding_window, hf.query_pre_attn_scalar,
                                                            hf.tie_word_embeddings, hf.layer_types)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        total = sum(p.numel() for p in AutoModelForCausalLM.from_config(HfGemma3TextConfig(
            **SPEC.to_hf_config(Gemma3TextConfig(name="g", **SPEC.from_hf_config(GEMMA3_1B))))).parameters())
    assert total == SPEC.params(Gemma3TextConfig(name="g", **SPEC.from_hf_config(GEMMA3_1B))).total == 999_885_952


def test_gemma3_1b_preset_is_the_published_config():
    from tests.conftest import compose

    m = compose(["model=gemma3_1b"]).model
    want = GEMMA3_1B
    assert dataclasses.replace(m, name="x") == Gemma3TextConfig(name="x", **SPEC.from_hf_config(want))
