"""Registers model family ``mistral`` (transformers' MistralForCausalLM; SGLang serves it by that name).

The shared dense decoder (workers/models/dense/), no biases or q/k norms, ``sliding_window`` on every
layer. config.json maps through :data:`HF`; absent keys mean what they mean to transformers 5.24's
MistralConfig (8 kv heads, a 4096 window, head_dim hidden/heads). Rotary scaling is refused.
"""
from __future__ import annotations

from workers.models.dense.family import BASE_FIELDS, BASE_FIXED, dense_spec
from workers.models.hf_config import HfConfigMap
from workers.models.mistral.config import MistralConfig

HF = HfConfigMap(
    family="mistral", architecture="MistralForCausalLM", model_type="mistral", fields=BASE_FIELDS, fixed=BASE_FIXED,
    defaults={"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 0, "max_position_embeddings": 131072,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": False})

SPEC = dense_spec("mistral", MistralConfig, HF, window="mistral",
                  summary="Mistral (GQA, free head_dim, sliding-window attention where config.json sets it)")
