"""tiny_moe against transformers' Qwen3-MoE with q/k norms off is not possible (Qwen3-MoE always has
them), so the harness is first checked here on the dense llama family against LlamaForCausalLM:
logits, gradients and greedy generation through the embedded engine."""
from __future__ import annotations

import torch

from tests.models.parity import (assert_engine_greedy_matches_hf, assert_grads_match, assert_logits_match,
                                 hf_reference, load_into)
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
