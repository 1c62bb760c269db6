"""tiny_moe against transformers' Qwen3-MoE with q/k norms off is not possible (Qwen3-MoE always has
them), so the harness is first checked here on the dense llama family against LlamaForCausalLM:
logits, gradients and greedy generation through the embedded engine; then llama's config.json
mapping (LlamaForCausalLM) both ways and transformers loading a directory written from our model."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.models.parity import (assert_engine_greedy_matches_hf, assert_from_pretrained_loads, assert_grads_match,
                                 assert_logits_match, hf_reference, load_into)
from workers.common.registry import MODELS
from workers.models.llama.config import LlamaConfig
from workers.models.tiny_moe.model import TinyMoeForCausalLM

HF_KW = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=64,
             tie_word_embeddings=False)
OURS = LlamaConfig(name="t", vocab_size=96, hidden_size=64, dense_intermediate_size=96, num_layers=2, num_heads=4,
                   num_kv_heads=2, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=64)


def _pair(tmp_path):
    from transformers import LlamaConfig as HfLlamaConfig

    hf, d = hf_reference(HfLlamaConfig(**HF_KW), tmp_path)
    return load_into(TinyMoeForCausalLM(OURS), d), hf


def test_llama_logits_grads_and_generation_match_transformers(tmp_path):
    ours, hf = _pair(tmp_path)
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(0))
    assert_logits_match(ours, hf, ids)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :4] = 0  # left padding, as the engine prefills
    assert_logits_match(ours, hf, ids, attention_mask=mask)
    assert_grads_match(ours, hf, ids)
    assert_engine_greedy_matches_hf(ours, hf, [[1, 2, 3], [5, 6, 7, 8, 9], [4]])


LLAMA = MODELS.get("llama")


def test_llama_config_json_round_trip_and_transformers_reads_it(tmp_path):
    from transformers import LlamaConfig as HfLlamaConfig

    assert LLAMA.hf_architectures == ("LlamaForCausalLM",)
    d = LLAMA.to_hf_config(OURS)
    assert LlamaConfig(name="t", **LLAMA.from_hf_config(d)) == OURS
    hf_cfg = HfLlamaConfig(**d)
    assert {k: getattr(hf_cfg, k) for k in HF_KW if k != "rope_theta"} == {k: v for k, v in HF_KW.items() if k != "rope_theta"}
    assert hf_cfg.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert LlamaConfig(name="t", **LLAMA.from_hf_config(HfLlamaConfig(**HF_KW).to_dict())) == OURS
    tied = dataclasses.replace(OURS, tie_word_embeddings=True, num_kv_heads=0)
    assert LLAMA.to_hf_config(tied)["num_key_value_heads"] == 4  # 0 means num_heads here, never in config.json


@pytest.mark.parametrize("key, value, why", [
    ("head_dim", 32, "head_dim=32 is not implemented"),
    ("mlp_bias", True, "mlp_bias=True is not implemented"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "rope_scaling=.* is not implemented"),
    ("sliding_window", 128, "key 'sliding_window'"),
])
def test_llama_config_json_keys_we_do_not_implement_are_refused(key, value, why):
    d = LLAMA.to_hf_config(OURS)
    d[key] = value
    with pytest.raises(ValueError, match=why):
        LLAMA.from_hf_config(d)


@pytest.mark.parametrize("tied", [False, True])
def test_transformers_loads_a_llama_directory_written_from_our_model(tmp_path, tied):
    cfg = dataclasses.replace(OURS, tie_word_embeddings=tied)
    ours = TinyMoeForCausalLM(cfg).init_weights(3).eval()
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    assert_from_pretrained_loads(ours, LLAMA.to_hf_config(cfg), tmp_path, ids)
