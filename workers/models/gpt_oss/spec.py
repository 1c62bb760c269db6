"""Registers model family ``gpt_oss`` (transformers' GptOssForCausalLM; gpt-oss-20b, gpt-oss-120b).

Torch-free at import: ``build`` / ``init`` import workers/models/gpt_oss/model.py when called.
Parameter names AND layouts are the checkpoint's (the experts' fused ``gate_up_proj [E, H, 2I]``
with interleaved gate/up columns: workers/models/blocks/moe_gpt_oss.py), so ``to_hf`` / ``from_hf``
are the identity and a published step is a bf16 GptOss checkpoint. MXFP4 checkpoints
(``quantization_config.quant_method: mxfp4``) are dequantised to bf16 by the loader
(workers/models/hf_checkpoint.py, workers/models/mxfp4.py) and published without
``quantization_config``. config.json maps through :data:`HF` plus the rotary keys (YaRN with
``truncate``, transformers 5's ``rope_parameters`` or the original ``rope_theta`` + ``rope_scaling``,
which wins when both are there, as in transformers; an absent or null rotary config means
transformers' default, YaRN factor 32). Router Replay forces every
layer's experts through ``forced_experts``. The trainer shards it with FSDP2 (tp = ep = 1) or the
mesh plan (tp > 1, workers/trainer/parallel/mesh.py): heads split with their q/k/v biases and sinks,
o_proj row-parallel with its bias added once, the vocabulary split over the untied head, the
experts replicated over tp with the tokens split (workers/trainer/parallel/expert.py) and
FSDP-sharded; under ep > 1 each fused stack (and its bias) is a DTensor sharded on its expert
dim over the ep mesh, so checkpoints, full gathers and the published step hold the whole stacks
(workers/models/blocks/moe_gpt_oss.py), and the tokens move by the shared all-to-all.
SGLang serves it as ``GptOssForCausalLM``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from workers.common.registry import MODELS
from workers.models import layer_types as lt
from workers.models.checks import check_gqa, check_moe
from workers.models.facts import Architecture, ParamCount
from workers.models.gpt_oss.config import GptOssConfig
from workers.models.hf_config import HfConfigMap
from workers.models.spec import ModelSpec

HF = HfConfigMap(
    family="gpt_oss", architecture="GptOssForCausalLM", model_type="gpt_oss",
    fields={"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
            "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
            "max_position_embeddings": "max_position_embeddings", "rms_norm_eps": "rms_norm_eps",
            "tie_word_embeddings": "tie_word_embeddings", "attention_bias": "attention_bias",
            "num_local_experts": "num_experts", "num_experts_per_tok": "top_k",
            "intermediate_size": "expert_intermediate_size", "swiglu_alpha": "swiglu_alpha",
            "swiglu_limit": "swiglu_limit", "sliding_window": "sliding_window"},
    fixed={"attention_dropout": 0.0},
    # hidden_act: GPT-OSS's experts apply their clamped SwiGLU whatever it says; initial_context_length:
    # the original code's name for rope_parameters.original_max_position_embeddings (transformers ignores it);
    # the aux-loss knobs are training options (ours: trainer.aux_loss_coef).
    inert=frozenset({"hidden_act", "initial_context_length", "router_aux_loss_coef", "output_router_logits"}),
    aliases={"num_experts": "num_local_experts", "experts_per_token": "num_experts_per_tok"},
    # transformers' GptOssConfig values for absent keys (5.24), so a sparse config.json means what it means there.
    defaults={"vocab_size": 201_088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
              "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131_072,
              "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": True, "num_local_experts": 128,
              "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "sliding_window": 128})
DEFAULT_THETA = 150_000.0
YARN_DEFAULT = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
"""transformers' GptOssConfig rotary parameters when config.json gives none."""
YARN_KEYS = {"factor": "rope_factor", "original_max_position_embeddings": "rope_original_max_position_embeddings",
             "beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow", "truncate": "rope_truncate"}


def to_hf_config(m: GptOssConfig) -> dict:
    """config.json of ``m``: transformers 5's ``rope_parameters`` and the original ``rope_theta`` +
    ``rope_scaling`` (SGLang's reader); an unscaled model writes ``rope_type: default`` explicitly,
    since an absent or null rotary config means YaRN to transformers."""
    out = HF.to_hf(m)
    theta = float(m.rope_theta)
    scaling: dict[str, Any] = {"rope_type": m.rope_scaling}
    if m.rope_scaling == "yarn":
        scaling.update({key: getattr(m, field) for key, field in YARN_KEYS.items()})
    out.update(num_key_value_heads=m.kv_heads, layer_types=list(m.layer_types), rope_theta=theta,
               rope_scaling=dict(scaling), rope_parameters={**scaling, "rope_theta": theta})
    return out


def from_hf_config(config: dict) -> dict:
    d = dict(config)
    for alias, key in HF.aliases.items():
        if alias in d and key in d and d[alias] != d[key]:
            raise ValueError(f"config.json: {alias}={d[alias]!r} disagrees with {key}={d[key]!r}")
    rope = _rope(d)
    types = lt.from_hf(d, d.get("num_hidden_layers", HF.defaults["num_hidden_layers"]), 2)
    if d.get("sliding_window", 0) is None:
        d["sliding_window"] = 0  # no window: refused at plan time if a layer slides
    out = HF.from_hf(d)
    out.update(rope, layer_types=types)
    for key in ("swiglu_alpha", "swiglu_limit"):
        out[key] = float(out[key])
    return out


def _rope(d: dict) -> dict:
    """Rotary fields from either spelling (popped from ``d``): ValueError for what is not implemented."""
    params, scaling, theta = d.pop("rope_parameters", None), d.pop("rope_scaling", None), d.pop("rope_theta", None)
    # transformers 5's priority (convert_rope_params_to_dict): a non-empty rope_scaling, then rope_parameters
    p = dict(scaling or (params if params is not None else YARN_DEFAULT))
    theta = float(p.pop("rope_theta", theta if theta is not None else DEFAULT_THETA))
    kind = p.pop("rope_type", None) or p.pop("type", None) or "default"
    p.pop("type", None)
    if p.pop("attention_factor", None) is not None or any(p.pop(k, None) for k in ("mscale", "mscale_all_dim")):
        raise ValueError(f"config.json: rope {kind} attention_factor / mscale are not implemented by model family "
                         f"gpt_oss (the attention factor is YaRN's 0.1 ln(factor) + 1)")
    if kind == "default" and not p:
        return {"rope_theta": theta, "rope_scaling": "default"}
    if kind != "yarn":
        raise ValueError(f"config.json: rope_type={kind!r} with {p} is not implemented by model family gpt_oss "
                         f"(default or yarn)")
    unknown = sorted(set(p) - set(YARN_KEYS))
    if unknown or p.get("factor") is None:
        raise ValueError(f"config.json: yarn rotary parameters {p} are not implemented by model family gpt_oss "
                         f"(it needs 'factor' and reads {sorted(YARN_KEYS)})")
    out = {"rope_theta": theta, "rope_scaling": "yarn", "rope_factor": float(p["factor"]),
           "rope_original_max_position_embeddings": int(p.get("original_max_position_embeddings") or
                                                        d.get("max_position_embeddings",
                                                              HF.defaults["max_position_embeddings"])),
           "rope_beta_fast": float(p.get("beta_fast") or 32.0), "rope_beta_slow": float(p.get("beta_slow") or 1.0),
           "rope_truncate": bool(p.get("truncate", True))}
    return out


def build(model_cfg, *, device=None, dtype=None):
    from workers.models.gpt_oss import model

    return model.build(model_cfg, device=device, dtype=dtype)


def init(model_cfg, dtype):
    from workers.models.gpt_oss import model

    return model.init(model_cfg, dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GptOssArchitecture(Architecture):
    """The shared counts (attention biases and sinks included) plus the router's bias and the experts'
    biases, which the shared formulas do not have."""

    def params(self) -> ParamCount:
        p = super().params()
        per_expert_bias = 2 * self.expert_intermediate_size + self.hidden_size
        layer, active = self.num_experts * (1 + per_expert_bias), self.num_experts + self.top_k * per_expert_bias
        return dataclasses.replace(p, total=p.total + self.num_layers * layer, active=p.active + self.num_layers * active)


def arch(m: GptOssConfig) -> Architecture:
    return GptOssArchitecture(vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers,
                              num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                              num_experts=m.num_experts, top_k=m.top_k, expert_intermediate_size=m.expert_intermediate_size,
                              tie_word_embeddings=m.tie_word_embeddings, qkv_bias=m.attention_bias,
                              o_bias=m.attention_bias, attention_sinks=True)


def check(cfg) -> None:
    """Plan time: the numbers of the config fit together (each message names the key and the numbers)."""
    m = cfg.model
    check_gqa(m)
    check_moe(m)
    if m.head_dim % 2:
        raise ValueError(f"model.head_dim({m.head_dim}) must be even (rotary embedding)")
    lt.check(m)


SPEC = MODELS.register(ModelSpec(
    name="gpt_oss", config=GptOssConfig, check=check, arch=arch, build=build, init=init,
    router_hook="forced_experts", hf_architectures=(HF.architecture,), to_hf_config=to_hf_config,
    from_hf_config=from_hf_config,
    summary="GPT-OSS (attention sinks + biases, alternating sliding window, YaRN, biased router, clamped SwiGLU "
            "experts; MXFP4 dequantised on load)"))
