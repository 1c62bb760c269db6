"""Registers model family ``qwen2`` (transformers' Qwen2ForCausalLM: Qwen2, Qwen2.5, Qwen2.5-Math).

The shared dense decoder (workers/models/dense/) with q/k/v biases. config.json maps through :data:`HF`
plus Qwen's sliding-window keys (workers/models/dense/family.py); absent keys mean what they mean to
transformers 5.24's Qwen2Config (32 kv heads, head_dim hidden/heads). ``attention_bias`` is read and
dropped: Qwen2ForCausalLM builds its biases whatever the key says. Rotary scaling is refused.
"""
from __future__ import annotations

from workers.models.dense.family import BASE_FIELDS, BASE_FIXED, dense_spec
from workers.models.hf_config import HfConfigMap
from workers.models.qwen2.config import Qwen2Config

HF = HfConfigMap(
    family="qwen2", architecture="Qwen2ForCausalLM", model_type="qwen2", fields=BASE_FIELDS, fixed=BASE_FIXED,
    inert=frozenset({"attention_bias"}),
    defaults={"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 0, "max_position_embeddings": 32768,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": False})

SPEC = dense_spec("qwen2", Qwen2Config, HF, window="qwen",
                  summary="Qwen2 / Qwen2.5 / Qwen2.5-Math (q/k/v biases, GQA, tied or untied head)")
