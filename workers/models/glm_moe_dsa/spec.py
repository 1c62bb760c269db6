"""Registers model family ``glm_moe_dsa`` (GlmMoeDsaForCausalLM: GLM-5).

DeepSeek-V3's blocks (MLA, dense + sigmoid-routed MoE layers, shared experts; interleaved
rotary always) plus the DeepSeek Sparse Attention indexer (workers/models/blocks/dsa_indexer.py:
each query attends to its ``index_topk`` best keys; in query chunks of ``dsa_chunk_tokens``, memory
linear in the sequence: workers/models/blocks/dsa_sparse.py). The embedded engine
serves it (latent + indexer-key cache); the trainer shards it with the generic plans (FSDP2; the mesh plan
with tp or ep > 1, where the DSA indexer stays replicated over tp). MTP layers: counted, not built.
"""
from __future__ import annotations

import dataclasses

from workers.common.registry import MODELS
from workers.models.checks import positive
from workers.models.deepseek_v3 import hf_config
from workers.models.deepseek_v3.spec import arch_fields
from workers.models.deepseek_v3.spec import check as check_deepseek_v3
from workers.models.facts import Architecture, ParamCount
from workers.models.glm_moe_dsa.config import GlmMoeDsaConfig, indexer_types
from workers.models.spec import ModelSpec


@dataclasses.dataclass(frozen=True, kw_only=True)
class DsaArchitecture(Architecture):
    """MLA + indexer, where ``shared`` layers have no indexer weights of their own."""

    num_shared_index_layers: int = 0
    index_topk: int = 0
    """Keys each query attends to (the memory-linear path keeps ``[T, index_topk]`` int32 positions)."""
    dsa_chunk_tokens: int = 0
    """Queries scored and attended at a time (0: the dense reference path, [T, T] per layer)."""

    def params(self) -> ParamCount:
        p = super().params()
        d, nh = self.indexer_head_dim, self.num_indexer_heads
        one = self.q_lora_rank * nh * d + self.hidden_size * d + 2 * d + self.hidden_size * nh
        less = self.num_shared_index_layers * one
        return ParamCount(total=p.total - less, active=p.active - less, mtp=p.mtp)


def arch(m: GlmMoeDsaConfig) -> Architecture:
    return DsaArchitecture(**arch_fields(m), num_indexer_heads=m.num_indexer_heads,
                           indexer_head_dim=m.indexer_head_dim, num_shared_index_layers=m.indexer_pattern.count("S"),
                           index_topk=m.index_topk, dsa_chunk_tokens=m.dsa_chunk_tokens)


def check(cfg) -> None:
    m = cfg.model
    check_deepseek_v3(cfg)
    positive("model.q_lora_rank", m.q_lora_rank)  # the indexer reads the query latent
    if m.indexer_head_dim < m.qk_rope_head_dim:
        raise ValueError(f"model.indexer_head_dim({m.indexer_head_dim}) must be >= model.qk_rope_head_dim"
                         f"({m.qk_rope_head_dim}): its first qk_rope_head_dim channels are rotated")
    if m.indexer_pattern and len(m.indexer_pattern) != m.num_layers:
        raise ValueError(f"model.indexer_pattern has {len(m.indexer_pattern)} letters; model.num_layers is "
                         f"{m.num_layers}")
    if not m.rope_interleave:
        raise ValueError("model.rope_interleave=false: GLM-5 always rotates interleaved pairs")


def to_hf_config(m: GlmMoeDsaConfig) -> dict:
    out = hf_config.to_hf_config(m, "GlmMoeDsaForCausalLM", "glm_moe_dsa")
    n_dense = m.num_dense_layers
    out.update(index_n_heads=m.num_indexer_heads, index_head_dim=m.indexer_head_dim, index_topk=m.index_topk,
               indexer_types=indexer_types(m), head_dim=m.qk_rope_head_dim,
               mlp_layer_types=["dense"] * n_dense + ["sparse"] * (m.num_layers - n_dense),
               layer_types=["indexed_attention"] * m.num_layers)
    return out


def _glm_keys(d: dict, out: dict) -> set:
    """GLM-5's own config.json keys into ``out``; returns the keys handled."""
    for key, field in (("index_n_heads", "num_indexer_heads"), ("index_head_dim", "indexer_head_dim"),
                       ("index_topk", "index_topk")):
        if d.get(key) is not None:
            out[field] = d[key]
    layers, n_dense = d.get("num_hidden_layers", 0), d.get("first_k_dense_replace", 0) or 0
    types = d.get("indexer_types")
    if types is None and d.get("index_topk_pattern") is not None:
        types = list(d["index_topk_pattern"])
    if types is None:
        freq, offset = max(d.get("index_topk_freq", 1), 1), d.get("index_skip_topk_offset", 2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    letters = "".join({"full": "F", "shared": "S", "F": "F", "S": "S"}.get(t, "?") for t in types)
    if "?" in letters:
        raise ValueError(f"config.json indexer_types={types!r}: each must be 'full' or 'shared'")
    out["indexer_pattern"] = "" if set(letters) <= {"F"} else letters
    mlp = d.get("mlp_layer_types")
    if mlp is not None and list(mlp) != ["dense"] * n_dense + ["sparse"] * (layers - n_dense):
        raise ValueError(f"config.json mlp_layer_types={mlp!r} is not implemented: only first_k_dense_replace "
                         f"({n_dense}) dense layers, then sparse")
    if any(t != "indexed_attention" for t in d.get("layer_types") or []):
        raise ValueError(f"config.json layer_types={d['layer_types']!r} is not implemented (indexed_attention only)")
    return {"index_n_heads", "index_head_dim", "index_topk", "indexer_types", "index_topk_pattern", "index_topk_freq",
            "index_skip_topk_offset", "mlp_layer_types", "layer_types"}


def from_hf_config(d: dict) -> dict:
    out = hf_config.from_hf_config(d, extra=_glm_keys)
    out["rope_interleave"] = True  # GLM-5's code rotates interleaved pairs whatever rope_interleave says
    return out


def build(model_cfg, *, device=None, dtype=None):
    from workers.models.glm_moe_dsa import model

    return model.build(model_cfg, device=device, dtype=dtype)


def init(model_cfg, dtype):
    from workers.models.glm_moe_dsa import model

    return model.init(model_cfg, dtype)


SPEC = MODELS.register(ModelSpec(
    name="glm_moe_dsa", config=GlmMoeDsaConfig, check=check, arch=arch, build=build, init=init,
    router_hook="forced_experts", not_built=hf_config.is_mtp, hf_architectures=("GlmMoeDsaForCausalLM",), to_hf_config=to_hf_config,
    from_hf_config=from_hf_config,
    summary="GLM-5 (MLA + DSA indexer + sigmoid-routed MoE; MTP layers counted, not built; trains under FSDP2 "
            "or the tp/ep mesh plan)"))
