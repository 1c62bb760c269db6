"""config.json <-> ``model.*`` of family ``llama`` (HF ``LlamaForCausalLM``; SmolLM2 is one).

Torch-free (the launcher maps config.json with it for ``model.path``; the publisher writes a
step's config.json with it). Every config.json key either maps to a field, is one of the keys
that do not change the computed function (workers/models/hf_dir.py COMMON_KEYS), or has the one
value our model implements (no biases, SiLU, default RoPE, head_dim = hidden/heads); anything
else is refused with the key named, so a checkpoint never loads into a model that computes a
different function.
"""
from __future__ import annotations

from workers.models.hf_dir import refuse_unknown, require

ARCHITECTURE = "LlamaForCausalLM"
FIELDS = {  # config.json key -> LlamaConfig field
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "dense_intermediate_size",
    "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads",
    "max_position_embeddings": "max_position_embeddings", "rms_norm_eps": "rms_norm_eps",
    "tie_word_embeddings": "tie_word_embeddings"}
FIXED = ("hidden_act", "attention_bias", "mlp_bias", "attention_dropout", "pretraining_tp", "head_dim",
         "rope_parameters", "rope_theta", "rope_scaling")


def from_hf_config(d: dict) -> dict:
    """{LlamaConfig field: value} of a Llama config.json; ValueError naming a key we do not implement."""
    refuse_unknown(d, [*FIELDS, *FIXED])
    require(d, "model_type", ["llama"])
    require(d, "hidden_act", ["silu"], "silu")
    require(d, "attention_bias", [False], False)
    require(d, "mlp_bias", [False], False)
    require(d, "attention_dropout", [0.0], 0.0)
    require(d, "pretraining_tp", [1], 1)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(d.get(key), int):
            raise ValueError(f"key {key!r} must be an integer, got {d.get(key)!r}")
    heads = d["num_attention_heads"]
    require(d, "head_dim", [d["hidden_size"] // heads], d["hidden_size"] // heads)
    out = {field: d[key] for key, field in FIELDS.items() if key in d}
    out.setdefault("num_kv_heads", heads)
    out.setdefault("tie_word_embeddings", False)  # LlamaConfig's default
    out["rope_theta"] = float(_rope_theta(d))
    return out


def _rope_theta(d: dict) -> float:
    """transformers 5 writes ``rope_parameters``; 4.x wrote ``rope_theta`` + ``rope_scaling``."""
    rope = d.get("rope_parameters")
    if rope is not None:
        if not isinstance(rope, dict):
            raise ValueError(f"key 'rope_parameters' must be an object, got {rope!r}")
        require(rope, "rope_type", ["default"], "default")
        extra = sorted(set(rope) - {"rope_type", "rope_theta"})
        if extra:
            raise ValueError(f"key 'rope_parameters' has {extra}: only default RoPE (rope_theta) is implemented")
        return rope.get("rope_theta", d.get("rope_theta", 10000.0))
    if d.get("rope_scaling") is not None:
        raise ValueError(f"key 'rope_scaling'={d['rope_scaling']!r} is not implemented (default RoPE only)")
    return d.get("rope_theta", 10000.0)


def to_hf_config(m) -> dict:
    """The config.json of a LlamaConfig: what a published step carries so transformers and SGLang load it."""
    return {"architectures": [ARCHITECTURE], "model_type": "llama", "vocab_size": m.vocab_size,
            "hidden_size": m.hidden_size, "intermediate_size": m.dense_intermediate_size,
            "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
            "num_key_value_heads": m.num_kv_heads or m.num_heads, "head_dim": m.hidden_size // m.num_heads,
            "hidden_act": "silu", "max_position_embeddings": m.max_position_embeddings,
            "rms_norm_eps": m.rms_norm_eps, "tie_word_embeddings": m.tie_word_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta}, "rope_theta": m.rope_theta,
            "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1}
