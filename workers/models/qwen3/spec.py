"""Registers model family ``qwen3`` (transformers' Qwen3ForCausalLM; SGLang serves it by that name).

The shared dense decoder (workers/models/dense/) with per-head q/k norms. config.json maps through
:data:`HF` plus Qwen's sliding-window keys (workers/models/dense/family.py); absent keys mean what
they mean to transformers 5.24's Qwen3Config (head_dim 128, 32 kv heads). Rotary scaling is refused.
"""
from __future__ import annotations

from workers.models.dense.family import BASE_FIELDS, BASE_FIXED, dense_spec
from workers.models.hf_config import HfConfigMap
from workers.models.qwen3.config import Qwen3Config

HF = HfConfigMap(
    family="qwen3", architecture="Qwen3ForCausalLM", model_type="qwen3",
    fields={**BASE_FIELDS, "attention_bias": "attention_bias"}, fixed=BASE_FIXED,
    defaults={"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False})

SPEC = dense_spec("qwen3", Qwen3Config, HF, window="qwen",
                  summary="dense Qwen3 (q/k norms, free head_dim, GQA, tied or untied head, optional sliding window)")
