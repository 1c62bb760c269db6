"""config.json of family ``nemotron_h``: our ``model.*`` fields <-> transformers' NemotronHConfig keys.

``to_hf_config`` writes what transformers 5.x and SGLang read (``layers_block_type`` and the
released checkpoints' ``hybrid_override_pattern``); ``from_hf_config`` reads a checkpoint's
config.json (5.x names, or the older ``mamba_*`` aliases and pattern string) and refuses any key
whose value the model would not honour, naming it. Torch-free.
"""
from __future__ import annotations

from typing import Any

from workers.models.nemotron_h.config import LAYER_KINDS, LEGACY_KINDS, NemotronHConfig

ARCHITECTURES = ("NemotronHForCausalLM",)

# our field -> HF key, for fields written and read as they are
PLAIN = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_heads": "num_attention_heads",
         "head_dim": "head_dim", "max_position_embeddings": "max_position_embeddings",
         "intermediate_size": "intermediate_size", "mamba_num_heads": "mamba_num_heads",
         "mamba_head_dim": "mamba_head_dim", "ssm_state_size": "ssm_state_size", "mamba_n_groups": "n_groups",
         "conv_kernel": "conv_kernel", "use_conv_bias": "use_conv_bias", "time_step_min": "time_step_min",
         "time_step_max": "time_step_max", "time_step_floor": "time_step_floor", "num_experts": "n_routed_experts",
         "top_k": "num_experts_per_tok", "expert_intermediate_size": "moe_intermediate_size",
         "shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
         "num_shared_experts": "n_shared_experts", "n_group": "n_group", "topk_group": "topk_group",
         "norm_topk_prob": "norm_topk_prob", "routed_scaling_factor": "routed_scaling_factor",
         "norm_eps": "layer_norm_epsilon", "init_std": "initializer_range", "num_mtp_layers": "num_nextn_predict_layers"}
# older spellings transformers still accepts
ALIASES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_dt_min": "time_step_min",
           "mamba_dt_max": "time_step_max", "mamba_dt_init_floor": "time_step_floor", "mamba_conv_bias": "use_conv_bias",
           "mamba_chunk_size": "chunk_size", "mamba_expand": "expand", "mamba_dt_limit": "time_step_limit",
           "norm_eps": "layer_norm_epsilon", "num_local_experts": "n_routed_experts"}
# key -> the only value(s) implemented (the reference's behaviour for any other is not built here)
REQUIRED = {"mlp_hidden_act": ("relu2",), "mamba_hidden_act": ("silu",), "attention_bias": (False,),
            "mlp_bias": (False,), "use_bias": (False,), "mamba_proj_bias": (False,), "tie_word_embeddings": (False,),
            "sliding_window": (None,), "mamba_ssm_cache_dtype": ("float32",), "attention_dropout": (0, 0.0),
            "hidden_dropout": (0, 0.0)}
# keys with no effect on the function computed: kernels, generation, bookkeeping, init-only, or ignored by the
# reference (time_step_limit: transformers 5.x floors dt at time_step_min and never caps it; rope_*: no RoPE)
IGNORED = {"architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "auto_map", "bos_token_id",
           "eos_token_id", "pad_token_id", "use_cache", "num_logits_to_keep", "output_router_logits", "chunk_size",
           "expand", "time_step_limit", "use_mamba_kernels", "moe_shared_expert_overlap", "residual_in_fp32",
           "rescale_prenorm_residual", "mtp_layers_block_type", "mtp_hybrid_override_pattern", "num_hidden_layers",
           "rope_theta", "partial_rotary_factor", "layers_block_type", "hybrid_override_pattern",
           # what every transformers PretrainedConfig.to_dict() carries
           "_name_or_path", "return_dict", "output_attentions", "output_hidden_states", "id2label", "label2id",
           "problem_type", "is_encoder_decoder", "chunk_size_feed_forward", "tokenizer_class"}


def to_hf_config(m: NemotronHConfig) -> dict[str, Any]:
    """config.json for transformers' NemotronHForCausalLM (and SGLang's loader)."""
    out: dict[str, Any] = {"architectures": list(ARCHITECTURES), "model_type": "nemotron_h"}
    out.update({hf: getattr(m, ours) for ours, hf in PLAIN.items()})
    out.update(num_key_value_heads=m.kv_heads, head_dim=m.attn_head_dim, moe_latent_size=m.moe_latent_size or None,
               layers_block_type=[LAYER_KINDS[c] for c in m.hybrid_override_pattern],
               hybrid_override_pattern=m.hybrid_override_pattern, num_hidden_layers=m.num_layers,
               mlp_hidden_act="relu2", mamba_hidden_act="silu", attention_bias=False, mlp_bias=False, use_bias=False,
               tie_word_embeddings=False, mamba_ssm_cache_dtype="float32")
    return out


def _pattern(cfg: dict) -> str:
    kinds = cfg.get("layers_block_type")
    if kinds is None:
        pattern = cfg.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or not pattern:
            raise ValueError("config.json: nemotron_h needs layers_block_type or hybrid_override_pattern")
        return pattern
    by_name = {v: k for k, v in LAYER_KINDS.items()} | LEGACY_KINDS
    unknown = sorted({k for k in kinds if k not in by_name})
    if unknown:
        raise ValueError(f"config.json layers_block_type has {unknown}; nemotron_h implements {sorted(by_name)}")
    return "".join(by_name[k] for k in kinds)


def from_hf_config(cfg: dict) -> dict[str, Any]:
    """config.json -> {model field: value}; ValueError names a key whose value is not implemented."""
    cfg = dict(cfg)
    for old, new in ALIASES.items():
        if old in cfg:
            cfg.setdefault(new, cfg.pop(old))
    unknown = sorted(set(cfg) - set(PLAIN.values()) - set(REQUIRED) - IGNORED - {"num_key_value_heads",
                                                                                  "moe_latent_size"})
    if unknown:
        raise ValueError(f"config.json keys {unknown} are not implemented by model family nemotron_h")
    for key, allowed in REQUIRED.items():
        if key in cfg and cfg[key] not in allowed:
            raise ValueError(f"config.json {key}={cfg[key]!r} is not implemented by model family nemotron_h "
                             f"(implemented: {list(allowed)})")
    pattern = _pattern(cfg)
    if "num_hidden_layers" in cfg and cfg["num_hidden_layers"] != len(pattern):
        raise ValueError(f"config.json num_hidden_layers={cfg['num_hidden_layers']} != {len(pattern)} layer kinds "
                         f"in layers_block_type / hybrid_override_pattern")
    out = {ours: cfg[hf] for ours, hf in PLAIN.items() if hf in cfg}
    out.update(hybrid_override_pattern=pattern, num_layers=len(pattern), moe_latent_size=cfg.get("moe_latent_size") or 0)
    if "num_key_value_heads" in cfg:
        out["num_kv_heads"] = cfg["num_key_value_heads"]
    return out
