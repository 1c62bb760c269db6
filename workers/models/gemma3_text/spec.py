"""Registers model family ``gemma3_text`` (transformers' Gemma3ForCausalLM; Gemma 3 270M / 1B).

Torch-free at import: ``build`` / ``init`` import workers/models/gemma3_text/model.py when called.
Parameter names are the checkpoint's, so ``to_hf`` / ``from_hf`` are the identity; config.json maps
through :data:`HF` plus the rotary keys Gemma 3 has per layer type (``rope_theta`` and
``rope_local_base_freq``, or transformers 5's ``rope_parameters`` keyed by ``full_attention`` /
``sliding_attention``; linear scaling of the full layers is implemented, any other is refused), and
refuses logit soft-capping (null in every Gemma 3 config), bidirectional attention, attention
biases and any key the model does not implement, naming it. The trainer shards it with FSDP2
(tp = ep = 1) or the mesh plan (tp > 1, workers/trainer/parallel/mesh.py): heads split, the ``(1 + w)``
q/k norms replicated with a TP-summed gradient (their ``scaled`` is the formula the TP wrapper
applies), the GELU-tanh MLP column/row split, the scaled embedding vocab-parallel when the head is
untied (tied: the embedding is the head and stays replicated). SGLang serves it by its architecture
name (``Gemma3ForCausalLM``).
"""
from __future__ import annotations

import dataclasses

from workers.common.registry import MODELS
from workers.models import layer_types as lt
from workers.models.checks import check_gqa, positive
from workers.models.facts import Architecture, ParamCount
from workers.models.gemma3_text.config import Gemma3TextConfig
from workers.models.hf_config import HfConfigMap
from workers.models.spec import ModelSpec

HF = HfConfigMap(
    family="gemma3_text", architecture="Gemma3ForCausalLM", model_type="gemma3_text",
    fields={"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
            "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
            "max_position_embeddings": "max_position_embeddings", "rms_norm_eps": "rms_norm_eps",
            "tie_word_embeddings": "tie_word_embeddings", "intermediate_size": "dense_intermediate_size",
            "query_pre_attn_scalar": "query_pre_attn_scalar", "sliding_window": "sliding_window"},
    fixed={"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False, "attention_dropout": 0.0,
           "final_logit_softcapping": None, "attn_logit_softcapping": None, "use_bidirectional_attention": False},
    # hidden_act: Gemma 3 reads hidden_activation only; cache_implementation: a generate() hint.
    inert=frozenset({"hidden_act", "cache_implementation"}),
    # transformers' Gemma3TextConfig values for absent keys (5.24), so a sparse config.json means what it means there.
    defaults={"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096})
SLIDING_PERIOD = 6
"""transformers' default ``sliding_window_pattern``: every 6th layer full attention."""
ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor"}


def to_hf_config(m: Gemma3TextConfig) -> dict:
    """config.json of ``m``: both rotary spellings (transformers 5's per-layer-type ``rope_parameters``, and
    ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` that older readers such as SGLang take)."""
    out = HF.to_hf(m)
    scaled = m.rope_linear_factor != 1
    full = {"rope_type": "linear" if scaled else "default", "rope_theta": float(m.rope_theta)}
    if scaled:
        full["factor"] = float(m.rope_linear_factor)
    out.update(num_key_value_heads=m.kv_heads, layer_types=list(m.layer_types), rope_theta=float(m.rope_theta),
               rope_local_base_freq=float(m.rope_local_base_freq),
               rope_scaling={"rope_type": "linear", "factor": float(m.rope_linear_factor)} if scaled else None,
               rope_parameters={"full_attention": full, "sliding_attention": {
                   "rope_type": "default", "rope_theta": float(m.rope_local_base_freq)}})
    return out


def from_hf_config(config: dict) -> dict:
    d = dict(config)
    rope = _rope(d)
    num_layers = d.get("num_hidden_layers", HF.defaults["num_hidden_layers"])
    types = lt.from_hf(d, num_layers, SLIDING_PERIOD)
    if d.get("sliding_window", 0) is None:
        d["sliding_window"] = 0  # no window: refused at plan time if a layer slides
    out = HF.from_hf(d)
    out.update(rope, layer_types=types)
    return out


def _rope(d: dict) -> dict:
    """Rotary fields from either spelling (popped from ``d``): ValueError for what is not implemented."""
    params = d.pop("rope_parameters", None) or {}
    scaling = d.pop("rope_scaling", None)
    theta, local = d.pop("rope_theta", None), d.pop("rope_local_base_freq", None)
    if params and not set(params) <= set(lt.KINDS):
        raise ValueError(f"config.json: rope_parameters={params!r} is not implemented by model family gemma3_text "
                         f"(it reads rope_parameters keyed by {list(lt.KINDS)})")
    full = {**(params.get(lt.FULL) or {}), **(scaling or {})}
    sliding = dict(params.get(lt.SLIDING) or {})
    for where, p in (("full_attention", full), ("sliding_attention", sliding)):
        extra = sorted(set(p) - ROPE_KEYS)
        if extra:
            raise ValueError(f"config.json: rope_parameters.{where} keys {extra} are not implemented by model family "
                             f"gemma3_text (only {sorted(ROPE_KEYS)})")
    kind = full.get("rope_type", full.get("type", "default"))
    if kind not in ("default", "linear"):
        raise ValueError(f"config.json: rope_scaling / rope_parameters.full_attention rope_type={kind!r} is not "
                         f"implemented by model family gemma3_text (default or linear)")
    if sliding.get("rope_type", sliding.get("type", "default")) != "default":
        raise ValueError(f"config.json: rope_parameters.sliding_attention={sliding!r} is not implemented (only the "
                         f"default rotary embedding on sliding-window layers)")
    return {"rope_theta": float(full.get("rope_theta", theta if theta is not None else 1_000_000.0)),
            "rope_local_base_freq": float(sliding.get("rope_theta", local if local is not None else 10_000.0)),
            "rope_linear_factor": float(full.get("factor", 1.0)) if kind == "linear" else 1.0}


def build(model_cfg, *, device=None, dtype=None):
    from workers.models.gemma3_text import model

    return model.build(model_cfg, device=device, dtype=dtype)


def init(model_cfg, dtype):
    from workers.models.gemma3_text import model

    return model.init(model_cfg, dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemma3Architecture(Architecture):
    """The shared counts plus Gemma's two extra norms per layer (pre- and post-feedforward)."""

    def params(self) -> ParamCount:
        p = super().params()
        extra = 2 * self.hidden_size * self.num_layers
        return dataclasses.replace(p, total=p.total + extra, active=p.active + extra)


def arch(m: Gemma3TextConfig) -> Architecture:
    return Gemma3Architecture(vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers,
                              num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, qk_norm=True,
                              dense_intermediate_size=m.dense_intermediate_size,
                              tie_word_embeddings=m.tie_word_embeddings)


def check(cfg) -> None:
    """Plan time: the numbers of the config fit together (each message names the key and the numbers)."""
    m = cfg.model
    check_gqa(m)
    positive("model.dense_intermediate_size", m.dense_intermediate_size)
    if m.head_dim % 2:
        raise ValueError(f"model.head_dim({m.head_dim}) must be even (rotary embedding)")
    lt.check(m)


SPEC = MODELS.register(ModelSpec(
    name="gemma3_text", config=Gemma3TextConfig, check=check, arch=arch, build=build, init=init,
    router_hook=None, hf_architectures=(HF.architecture,), to_hf_config=to_hf_config, from_hf_config=from_hf_config,
    summary="Gemma 3 text (interleaved sliding/global attention, q/k norms, sandwich norms, scaled embeddings)"))
