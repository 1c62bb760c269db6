"""config.json <-> ``model.*`` of family deepseek_v3 (and, extended, glm_moe_dsa). Torch-free.

``to_hf_config`` writes what the original checkpoints' config.json holds (legacy ``rope_theta`` +
``rope_scaling``, ``topk_method: noaux_tc``, ``scoring_func: sigmoid``, which SGLang's DeepSeek
loader reads; transformers 5.x turns them into ``rope_parameters``). ``from_hf_config`` accepts
both that form and transformers 5.x's ``rope_parameters``, maps every key it implements, ignores
keys that do not change the network (token ids, dtype, serving hints: :data:`IGNORED`) and refuses
any other key, or a value of a known key that the model does not implement, naming it.

Multi-token-prediction layers (``num_nextn_predict_layers``) are accepted and counted but not
built: their weights (``model.layers.{num_hidden_layers}...``) are skipped on load.
"""
from __future__ import annotations

import re
from typing import Any, Callable

#: config.json key -> our field, for values taken as they are.
DIRECT = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads", "max_position_embeddings": "max_position_embeddings",
    "intermediate_size": "dense_intermediate_size", "moe_intermediate_size": "expert_intermediate_size",
    "n_routed_experts": "num_experts", "num_experts_per_tok": "top_k", "n_shared_experts": "num_shared_experts",
    "first_k_dense_replace": "num_dense_layers", "n_group": "num_expert_groups", "topk_group": "topk_groups",
    "routed_scaling_factor": "routed_scaling_factor", "norm_topk_prob": "norm_topk_prob",
    "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim", "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim", "num_nextn_predict_layers": "num_mtp_layers", "num_mtp_layers": "num_mtp_layers",
    "rms_norm_eps": "rms_norm_eps", "tie_word_embeddings": "tie_word_embeddings", "rope_interleave": "rope_interleave",
}
#: Keys that do not change the network's function (identity, tokens, dtype, serving and training hints).
IGNORED = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "auto_map",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range", "output_router_logits",
    "ep_size", "aux_loss_alpha", "seq_aux", "qk_head_dim", "id2label", "label2id", "return_dict",
    "output_hidden_states", "output_attentions", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder",
    "tokenizer_class", "pretraining_tp", "rope_theta", "rope_scaling", "rope_parameters", "q_lora_rank",
    "num_key_value_heads", "head_dim",  # checked against num_attention_heads / qk_rope_head_dim below
})
#: Keys accepted only with the value the model implements.
REQUIRED = {"hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "topk_method": "noaux_tc",
            "scoring_func": "sigmoid", "moe_layer_freq": 1, "mlp_bias": False}
ROPE_KEYS = {"factor": "rope_factor", "original_max_position_embeddings": "rope_original_max_position_embeddings",
             "beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow", "mscale": "rope_mscale",
             "mscale_all_dim": "rope_mscale_all_dim"}
FLOAT_FIELDS = ("routed_scaling_factor", "rms_norm_eps", "rope_theta", "rope_factor", "rope_beta_fast",
                "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim")


def to_hf_config(m, architecture: str = "DeepseekV3ForCausalLM", model_type: str = "deepseek_v3") -> dict:
    """The config.json of a model section (``architectures``, ``model_type``, every field under its HF name)."""
    out: dict[str, Any] = {"architectures": [architecture], "model_type": model_type}
    for key, field in DIRECT.items():
        if key != "num_mtp_layers":
            out[key] = getattr(m, field)
    out.update(num_key_value_heads=m.num_heads, q_lora_rank=m.q_lora_rank or None, rope_theta=m.rope_theta,
               rope_scaling=rope_scaling(m), **REQUIRED)
    return out


def rope_scaling(m) -> dict | None:
    if m.rope_scaling == "default":
        return None
    out: dict[str, Any] = {"type": m.rope_scaling}
    for key, field in ROPE_KEYS.items():
        value = getattr(m, field)
        if key.startswith("mscale") and not value:
            continue  # 0: absent
        out[key] = value
    return out


def from_hf_config(d: dict, *, extra: Callable[[dict, dict], set] | None = None) -> dict:
    """{our field: value} from a config.json dict; ValueError naming each key we do not implement.

    ``extra(d, out) -> handled keys``: a subclass family's own keys (glm_moe_dsa's indexer)."""
    out: dict[str, Any] = {}
    handled = set(IGNORED) | set(DIRECT) | set(REQUIRED)
    if extra is not None:
        handled |= extra(d, out)
    if d.get("quantization_config"):
        raise ValueError("config.json quantization_config: quantized checkpoints (DeepSeek-V3/Kimi-K2's block FP8) "
                         "are not implemented yet; give a bf16/fp32 checkpoint")
    unknown = sorted(set(d) - handled)
    if unknown:
        raise ValueError(f"config.json keys {unknown} are not implemented by this model family")
    for key, field in DIRECT.items():
        if key in d and d[key] is not None:
            out[field] = d[key]
    for key, want in REQUIRED.items():
        if key in d and d[key] != want:
            raise ValueError(f"config.json {key}={d[key]!r} is not implemented (only {want!r})")
    heads = d.get("num_attention_heads")
    if d.get("num_key_value_heads") not in (None, heads):
        raise ValueError(f"config.json num_key_value_heads={d['num_key_value_heads']} must equal num_attention_heads"
                         f"={heads}: MLA expands its latent to every head")
    if d.get("head_dim") not in (None, d.get("qk_rope_head_dim")):
        raise ValueError(f"config.json head_dim={d['head_dim']} must equal qk_rope_head_dim (the rotary width)")
    out["q_lora_rank"] = d.get("q_lora_rank") or 0
    out.update(_rope(d))
    for field in FLOAT_FIELDS:
        if field in out:
            out[field] = float(out[field])
    return out


def _rope(d: dict) -> dict:
    params = dict(d.get("rope_parameters") or {})
    params.update(d.get("rope_scaling") or {})
    out: dict[str, Any] = {}
    theta = params.pop("rope_theta", d.get("rope_theta"))
    if theta is not None:
        out["rope_theta"] = float(theta)
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if kind not in ("default", "yarn"):
        raise ValueError(f"config.json rope_scaling.type={kind!r} is not implemented (default or yarn)")
    out["rope_scaling"] = kind
    if kind == "default":
        return out
    if params.pop("truncate", True) is not True:
        raise ValueError("config.json rope_scaling.truncate=false is not implemented")
    if params.get("attention_factor") is not None:
        raise ValueError("config.json rope_scaling.attention_factor is not implemented (derived from mscale)")
    params.pop("attention_factor", None)
    if params.get("factor") is None:
        raise ValueError("config.json rope_scaling.factor is required for yarn")
    params.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
    unknown = sorted(set(params) - set(ROPE_KEYS))
    if unknown:
        raise ValueError(f"config.json rope_scaling keys {unknown} are not implemented")
    for key, value in params.items():
        if value is not None:
            out[ROPE_KEYS[key]] = value
    return out


MTP_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def is_mtp(m, name: str) -> bool:
    """A multi-token-prediction tensor of a checkpoint: ``model.layers.{>= m.num_layers}...``
    (DeepSeek-V3, Kimi-K2 and GLM-5 store their MTP layers after the decoder layers). The spec's
    ``not_built``: the loader and the launcher's tensor check skip them."""
    found = MTP_LAYER.match(name)
    return found is not None and int(found[1]) >= m.num_layers
