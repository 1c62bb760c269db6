"""Registers model family ``llama``: the dense decoder (SmolLM2-135M, model=tiny_dense).

Same torch code as tiny_moe with no experts (workers/models/tiny_moe/model.py), same trainer
sharding (TP attention, TP MLP, vocabulary-parallel lm_head). No router: ``router_hook`` is None
and the plan refuses trainer.router_replay. Pretrained checkpoints: workers/models/pretrained.py
SOURCES of family llama, converted by workers/models/llama/convert.py. config.json maps through
:data:`HF` (LlamaForCausalLM; head_dim must be hidden/heads, no biases, no rotary scaling).
"""
from __future__ import annotations

from workers.common.registry import MODELS
from workers.models.checks import check_gqa, check_mha, positive
from workers.models.facts import Architecture
from workers.models.hf_config import HfConfigMap
from workers.models.llama.config import LlamaConfig
from workers.models.spec import ModelSpec
from workers.models.tiny_moe.spec import build, init


HF = HfConfigMap(
    family="llama", architecture="LlamaForCausalLM", model_type="llama",
    fields={"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
            "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads",
            "max_position_embeddings": "max_position_embeddings", "rms_norm_eps": "rms_norm_eps",
            "tie_word_embeddings": "tie_word_embeddings", "intermediate_size": "dense_intermediate_size"},
    fixed={"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
           "pretraining_tp": 1},
    extra=lambda m: {"head_dim": m.head_dim, "num_key_value_heads": m.kv_heads},
    # transformers' LlamaConfig values for absent keys (5.24); absent kv heads mean num_heads (our 0).
    defaults={"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 0, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": False})


def to_hf_config(m: LlamaConfig) -> dict:
    return HF.to_hf(m)


def from_hf_config(config: dict) -> dict:
    """HF's map, plus: ``head_dim`` (written by transformers 5) must be hidden_size / num_heads, the
    only head width this family builds."""
    config = dict(config)
    head_dim = config.pop("head_dim", None)
    out = HF.from_hf(config)
    if head_dim is not None and head_dim != out["hidden_size"] // out["num_heads"]:
        raise ValueError(f"config.json: head_dim={head_dim} is not implemented by model family llama (only "
                         f"hidden_size/num_attention_heads = {out['hidden_size'] // out['num_heads']})")
    return out


def arch(m: LlamaConfig) -> Architecture:
    return Architecture(vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers,
                        num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
                        dense_intermediate_size=m.dense_intermediate_size, tie_word_embeddings=m.tie_word_embeddings)


def check(cfg) -> None:
    m = cfg.model
    check_gqa(m)
    positive("model.dense_intermediate_size", m.dense_intermediate_size)
    check_mha(m)


SPEC = MODELS.register(ModelSpec(
    name="llama", config=LlamaConfig, check=check, arch=arch, build=build, init=init,
    router_hook=None, hf_architectures=(HF.architecture,), to_hf_config=to_hf_config, from_hf_config=from_hf_config,
    summary="dense Llama decoder (tiny_moe's code with no experts; SmolLM2)"))
