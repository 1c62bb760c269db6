"""The ModelSpec of a dense family (qwen3, qwen2, mistral), built once: config.json both ways, plan checks, facts.

Each family passes its :class:`HfConfigMap` (the keys it copies, the values it fixes, transformers'
defaults for absent keys) and how its config.json spells sliding-window attention:

- ``qwen``: Qwen2/Qwen3's ``use_sliding_window`` switch, ``sliding_window``, ``max_window_layers`` and
  ``layer_types``, read as transformers' Qwen2Config / Qwen3Config do (the window only with the switch
  on; without ``layer_types``, layers from ``max_window_layers`` on slide). Released Qwen2.5 / Qwen3
  checkpoints carry the switch off, which reads as no window at all.
- ``mistral``: ``sliding_window`` (null: none; absent: transformers' 4096) on every layer, as
  MistralForCausalLM applies it; ``layer_types`` (which MistralForCausalLM ignores) only when it says the same.

Torch-free: ``build`` / ``init`` import workers/models/dense/model.py when called.
"""
from __future__ import annotations

from typing import Any, Callable

from workers.common.registry import MODELS
from workers.models.checks import check_gqa, positive
from workers.models.dense.config import FULL, SLIDING, DenseConfig
from workers.models.facts import Architecture
from workers.models.hf_config import HfConfigMap
from workers.models.spec import ModelSpec

WINDOW_KEYS = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
BASE_FIELDS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
               "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
               "max_position_embeddings": "max_position_embeddings", "rms_norm_eps": "rms_norm_eps",
               "tie_word_embeddings": "tie_word_embeddings", "intermediate_size": "dense_intermediate_size"}
"""config.json key -> field, common to the three families (each may add its own)."""
BASE_FIXED = {"hidden_act": "silu", "attention_dropout": 0.0}


def _layer_types(value: Any, n: int, where: str) -> list[str]:
    if not (isinstance(value, list) and len(value) == n and all(v in (FULL, SLIDING) for v in value)):
        raise ValueError(f"{where}: layer_types={value!r} must list {FULL!r} or {SLIDING!r} for each of the "
                         f"{n} layers (num_hidden_layers)")
    return list(value)


def canonical_window(window: Any, types: list[str]) -> dict:
    """Our fields for a window over the ``types`` layers: no sliding layer reads as no window, every
    layer sliding as an empty ``layer_types`` (so a round trip compares equal)."""
    if not window or SLIDING not in types:
        return {"sliding_window": 0, "layer_types": []}
    return {"sliding_window": int(window), "layer_types": [] if FULL not in types else types}


def read_qwen_window(d: dict, n: int, where: str = "config.json") -> dict:
    """Qwen2Config / Qwen3Config's reading (transformers 5.24 ``__post_init__``), popped from ``d``."""
    use, window = d.pop("use_sliding_window", False), d.pop("sliding_window", 4096)
    first, types = d.pop("max_window_layers", 28), d.pop("layer_types", None)
    if not use or window is None:
        if types is not None:
            _layer_types(types, n, where)
        return canonical_window(0, [])
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"{where}: sliding_window={window!r} must be a positive number of keys")
    types = _layer_types(types, n, where) if types is not None else [SLIDING if i >= first else FULL for i in range(n)]
    return canonical_window(window, types)


def write_qwen_window(m: DenseConfig) -> dict:
    types = [SLIDING if m.layer_window(i) is not None else FULL for i in range(m.num_layers)]
    first = types.index(SLIDING) if SLIDING in types else m.num_layers
    return {"use_sliding_window": bool(m.sliding_window), "sliding_window": m.sliding_window or None,
            "max_window_layers": first, "layer_types": types}


def read_mistral_window(d: dict, n: int, where: str = "config.json") -> dict:
    """MistralConfig's reading: ``sliding_window`` on every layer (absent: 4096), popped from ``d``."""
    window, types = d.pop("sliding_window", 4096), d.pop("layer_types", None)
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"{where}: sliding_window={window!r} must be a positive number of keys or null")
    if types is not None and set(_layer_types(types, n, where)) != {SLIDING if window else FULL}:
        raise ValueError(f"{where}: layer_types={types!r} is not implemented by model family mistral: "
                         f"MistralForCausalLM applies sliding_window={window} to every layer (interleaved "
                         f"attention is Ministral's, another architecture)")
    return canonical_window(window, [SLIDING] * n)


def write_mistral_window(m: DenseConfig) -> dict:
    return {"sliding_window": m.sliding_window or None}


WINDOWS: dict[str, tuple[Callable, Callable]] = {"qwen": (read_qwen_window, write_qwen_window),
                                                 "mistral": (read_mistral_window, write_mistral_window)}


def dense_spec(name: str, config: type, hf: HfConfigMap, *, window: str, summary: str) -> ModelSpec:
    """Register family ``name`` (schema ``config``, a DenseConfig) with config.json map ``hf``."""
    read_window, write_window = WINDOWS[window]

    def to_hf_config(m: DenseConfig) -> dict:
        out = hf.to_hf(m)
        out.update(head_dim=m.attention_head_dim, num_key_value_heads=m.kv_heads)  # transformers reads them as is
        out.update(write_window(m))
        return out

    def from_hf_config(config: dict) -> dict:
        d = dict(config)
        for key in ("num_key_value_heads", "head_dim"):  # null: transformers' "num_heads" / "hidden / heads"
            if key in d and d[key] is None:
                d[key] = 0
        layers = d.get("num_hidden_layers", hf.defaults.get("num_hidden_layers"))
        fields = read_window(d, layers)
        return {**hf.from_hf(d), **fields}

    return MODELS.register(ModelSpec(
        name=name, config=config, check=check, arch=arch, build=build, init=init, router_hook=None,
        hf_architectures=(hf.architecture,), to_hf_config=to_hf_config, from_hf_config=from_hf_config,
        summary=summary))


def build(model_cfg, *, device=None, dtype=None):
    from workers.models.dense import model

    return model.build(model_cfg, device=device, dtype=dtype)


def init(model_cfg, dtype):
    from workers.models.dense import model

    return model.init(model_cfg, dtype)


def arch(m: DenseConfig) -> Architecture:
    return Architecture(vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers,
                        num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.attention_head_dim,
                        qk_norm=m.qk_norm, qkv_bias=m.qkv_bias, o_bias=m.o_bias,
                        dense_intermediate_size=m.dense_intermediate_size, tie_word_embeddings=m.tie_word_embeddings)


def check(cfg) -> None:
    """Plan time: the numbers fit together; a sliding window only where the inference backend computes it."""
    m = cfg.model
    check_gqa(m)
    positive("model.dense_intermediate_size", m.dense_intermediate_size)
    if not m.head_dim and m.hidden_size % m.num_heads:
        raise ValueError(f"model.head_dim=0 means hidden_size/num_heads, but model.num_heads({m.num_heads}) does not "
                         f"divide model.hidden_size({m.hidden_size}); set model.head_dim")
    if m.attention_head_dim % 2:
        raise ValueError(f"model.head_dim({m.attention_head_dim}) must be even (rotary embedding)")
    if m.layer_types and len(m.layer_types) != m.num_layers:
        raise ValueError(f"model.layer_types has {len(m.layer_types)} entries; it needs one per layer "
                         f"(model.num_layers={m.num_layers}) or none")
    if m.layer_types and not m.sliding_window:
        raise ValueError(f"model.layer_types={list(m.layer_types)} marks sliding layers but model.sliding_window=0 "
                         f"(no window); set the window or drop layer_types")
    if m.sliding_window and m.sliding_window < m.max_position_embeddings and _speaks_sglang(cfg):
        raise ValueError(f"model.sliding_window={m.sliding_window} < model.max_position_embeddings("
                         f"{m.max_position_embeddings}) with inference.backend={cfg.inference.backend}: SGLang 0.5.23's "
                         f"{MODELS.get(m.family).hf_architectures[0]} attends to every earlier key (it implements no "
                         f"window), so it would sample from another function than the trainer's; use "
                         f"inference.backend=embedded")


def _speaks_sglang(cfg) -> bool:
    from workers.common.registry import speaks_sglang

    return speaks_sglang(cfg)
