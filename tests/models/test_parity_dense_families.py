"""qwen3, qwen2 and mistral against transformers' Qwen3ForCausalLM, Qwen2ForCausalLM and MistralForCausalLM.

One decoder (workers/models/dense/) with the family's switches, so one parametrized file: tiny
configs built with transformers' own config classes from our ``to_hf_config``, covering what tells
the families apart: per-head q/k norms and a head width free of hidden/heads (qwen3, tied and
untied, with ``attention_bias``), q/k/v biases (qwen2), sliding-window attention SMALLER than the
sequences (mistral on every layer; qwen3 on the layers from ``max_window_layers`` on), GQA.
Each config: logits (with left padding), gradients by checkpoint name, greedy generation through
the dynamic and the static engine equal to transformers' ``generate``, the config.json round
trip, and transformers loading a directory written from OUR model with no missing/unexpected keys.
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from tests.models.parity import (assert_engine_greedy_matches_hf, assert_from_pretrained_loads, assert_grads_match,
                                 assert_logits_match, hf_reference, load_into)
from workers.common.registry import MODELS
from workers.models.dense.model import DenseForCausalLM
from workers.models.mistral.config import MistralConfig
from workers.models.qwen2.config import Qwen2Config
from workers.models.qwen3.config import Qwen3Config

SMALL = dict(name="t", vocab_size=96, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
             dense_intermediate_size=48, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=64)
CONFIGS = {
    "qwen3-tied-hd24": Qwen3Config(**{**SMALL, "head_dim": 24}, tie_word_embeddings=True),
    "qwen3-untied-bias-window": Qwen3Config(**{**SMALL, "num_layers": 3}, attention_bias=True, sliding_window=4,
                                            layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
    "qwen2-untied-mha": Qwen2Config(**{**SMALL, "num_kv_heads": 4}),
    "mistral-window5-hd32": MistralConfig(**{**SMALL, "head_dim": 32}, sliding_window=5),
}
IDS = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(0))
ERRORS: dict[str, dict[str, float]] = {}  # printed with -s: the measured parity errors


def spec(cfg):
    return MODELS.get(cfg.family)


def hf_config(cfg):
    from transformers import CONFIG_MAPPING

    d = spec(cfg).to_hf_config(cfg)
    return CONFIG_MAPPING[d["model_type"]](**d)


@pytest.fixture(params=sorted(CONFIGS), scope="module")
def pair(request, tmp_path_factory):
    cfg = CONFIGS[request.param]
    hf, d = hf_reference(hf_config(cfg), tmp_path_factory.mktemp(request.param))
    return request.param, cfg, load_into(DenseForCausalLM(cfg), d), hf


def test_the_modules_are_the_ones_transformers_builds(pair):
    name, cfg, ours, hf = pair
    assert type(hf).__name__ == spec(cfg).hf_architectures[0]
    windows = [layer.self_attn.sliding_window for layer in ours.model.layers]
    # Qwen's attention keeps its layer's window; Mistral's reads config.sliding_window in every layer
    assert windows == [getattr(layer.self_attn, "sliding_window", hf.config.sliding_window) for layer in hf.model.layers]
    assert windows == [cfg.layer_window(i) for i in range(cfg.num_layers)]
    assert (ours.lm_head is None) == cfg.tie_word_embeddings
    assert sum(p.numel() for p in ours.parameters()) == spec(cfg).params(cfg).total == sum(
        p.numel() for p in hf.parameters())


def test_logits_match_with_and_without_left_padding(pair):
    name, cfg, ours, hf = pair
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :4] = 0  # left padding, as the engine prefills
    ERRORS.setdefault(name, {})["logits"] = assert_logits_match(ours, hf, IDS)
    ERRORS[name]["logits_left_pad"] = assert_logits_match(ours, hf, IDS, attention_mask=mask)


def test_gradients_match(pair):
    name, cfg, ours, hf = pair
    ERRORS.setdefault(name, {})["grads"] = assert_grads_match(ours, hf, IDS)


def test_the_window_matters_where_there_is_one(pair):
    """With the window removed, a windowed config's logits change beyond the window (the test has teeth)."""
    name, cfg, ours, hf = pair
    if not cfg.sliding_window:
        return
    full = DenseForCausalLM(dataclasses.replace(cfg, sliding_window=0, layer_types=[]))
    full.load_state_dict(ours.state_dict())
    with torch.no_grad():
        a, b = ours(IDS).logits, full.eval()(IDS).logits
    torch.testing.assert_close(a[:, :cfg.sliding_window], b[:, :cfg.sliding_window])
    assert (a[:, cfg.sliding_window:] - b[:, cfg.sliding_window:]).abs().max() > 1e-3


@pytest.mark.parametrize("engine", ["dynamic", "static"])
def test_engine_greedy_equals_transformers_generate(pair, engine):
    from workers.inference.embedded.static_engine import StaticEngine

    name, cfg, ours, hf = pair
    make = None if engine == "dynamic" else functools.partial(StaticEngine, max_seq_len=40, prefill_chunk=3,
                                                              sync_every=3, smallest_key_window=8)
    assert_engine_greedy_matches_hf(ours, hf, [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4]], max_new_tokens=7,
                                    make_engine=make)


def test_config_json_round_trip(pair):
    name, cfg, ours, hf = pair
    schema = type(cfg)
    assert schema(name=cfg.name, **spec(cfg).from_hf_config(spec(cfg).to_hf_config(cfg))) == cfg
    # what transformers itself writes (rope_parameters, its derived layer_types, its own extra keys) reads back too
    assert schema(name=cfg.name, **spec(cfg).from_hf_config(hf.config.to_dict())) == cfg


def test_transformers_loads_a_directory_written_from_our_model(pair, tmp_path):
    name, cfg, ours, hf = pair
    seeded = DenseForCausalLM(cfg).init_weights(5).eval()
    ERRORS.setdefault(name, {})["from_pretrained"] = assert_from_pretrained_loads(
        seeded, spec(cfg).to_hf_config(cfg), tmp_path, IDS)
    print(f"\ndense families parity errors: {ERRORS}")


@pytest.mark.parametrize("family, key, value, why", [
    ("qwen3", "rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling=.* is not implemented"),
    ("qwen3", "hidden_act", "gelu", "hidden_act='gelu' is not implemented"),
    ("qwen3", "layer_types", ["full_attention"], "layer_types=.* must list"),
    ("qwen2", "rope_parameters", {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}, "is not implemented"),
    ("qwen2", "quantization_config", {"quant_method": "awq"}, "key 'quantization_config'"),
    ("qwen2", "architectures", ["Qwen3ForCausalLM"], "is not qwen2's"),
    ("mistral", "layer_types", ["full_attention", "sliding_attention"], "is not implemented by model family mistral"),
    ("mistral", "sliding_window", 0, "sliding_window=0 must be a positive"),
])
def test_config_json_keys_we_do_not_implement_are_refused(family, key, value, why):
    cfg = next(c for c in CONFIGS.values() if c.family == family)
    d = spec(cfg).to_hf_config(cfg)
    d[key] = value
    with pytest.raises(ValueError, match=why):
        spec(cfg).from_hf_config(d)


def test_released_qwen_configs_read_as_transformers_reads_them():
    """Qwen2.5 / Qwen3 checkpoints carry a window switched off (``use_sliding_window: false`` with a
    ``sliding_window`` and ``max_window_layers``): no window. Switched on, the layers from
    max_window_layers on slide; an absent key means transformers' default."""
    from transformers import Qwen2Config as HfQwen2, Qwen3Config as HfQwen3

    q25 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 96, "hidden_size": 64,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48,
           "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 2, "rope_theta": 1e6,
           "rope_scaling": None, "tie_word_embeddings": True, "attention_dropout": 0.0, "hidden_act": "silu"}
    for on in (False, True):
        ours = Qwen2Config(name="t", **MODELS.get("qwen2").from_hf_config({**q25, "use_sliding_window": on}))
        hf = HfQwen2(**{**q25, "use_sliding_window": on})
        assert [ours.layer_window(i) for i in range(4)] == [
            hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types]
    sparse = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 96, "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4}
    ours, hf = Qwen3Config(name="t", **MODELS.get("qwen3").from_hf_config(sparse)), HfQwen3(**sparse)
    assert (ours.kv_heads, ours.attention_head_dim, ours.dense_intermediate_size, ours.rope_theta, ours.sliding_window) == (
        hf.num_key_value_heads, hf.head_dim, hf.intermediate_size, hf.rope_parameters["rope_theta"], 0)
    m = MistralConfig(name="t", **MODELS.get("mistral").from_hf_config({**sparse, "architectures": ["MistralForCausalLM"],
                                                                        "model_type": "mistral"}))
    assert (m.kv_heads, m.attention_head_dim, m.sliding_window, m.max_position_embeddings) == (8, 16, 4096, 131072)


QWEN3_0_6B = {  # public config.json of Qwen/Qwen3-0.6B
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
    "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936}
QWEN2_5_7B = {  # public config.json of Qwen/Qwen2.5-7B-Instruct
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.43.1",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 152064}
MISTRAL_7B_V01 = {  # public config.json of mistralai/Mistral-7B-v0.1
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000}


@pytest.mark.parametrize("config, schema, total, window", [
    (QWEN3_0_6B, Qwen3Config, 596_049_920, 0), (QWEN2_5_7B, Qwen2Config, 7_615_616_512, 0),
    (MISTRAL_7B_V01, MistralConfig, 7_241_732_096, 4096)], ids=["qwen3-0.6b", "qwen2.5-7b", "mistral-7b-v0.1"])
def test_released_config_json_reads_and_counts_as_transformers(config, schema, total, window):
    """The config.json of a released checkpoint is accepted as it is, and the model it describes has
    transformers' (and the model card's) parameter count; mistral v0.1 keeps its 4096-key window."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    m = schema(name="real", **MODELS.get(schema.family).from_hf_config(config))
    assert m.sliding_window == window and m.layer_types == []
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(CONFIG_MAPPING[config["model_type"]](**config))
    assert MODELS.get(m.family).params(m).total == sum(p.numel() for p in hf.parameters()) == total
