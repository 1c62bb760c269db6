"""Registers model family ``glm_moe_dsa`` (GlmMoeDsaForCausalLM: GLM-5): plan only.

DeepSeek-V3's shape (MLA, dense + MoE layers, shared experts, MTP) plus the DeepSeek Sparse
Attention indexer, whose parameters the plan counts (workers/models/facts.py) and whose
per-token key the simulator adds to the KV bytes. Refused outside ``launcher.dry_run=true``.
"""
from __future__ import annotations

import dataclasses

from workers.common.config.ranges import ge, limits
from workers.common.registry import MODELS
from workers.models.checks import positive
from workers.models.deepseek_v3.spec import DeepseekV3Config, arch_fields
from workers.models.deepseek_v3.spec import check as check_deepseek_v3
from workers.models.facts import Architecture
from workers.models.spec import ModelSpec


@dataclasses.dataclass(kw_only=True)
class GlmMoeDsaConfig(DeepseekV3Config):
    family: str = "glm_moe_dsa"
    """Model family (workers/models registry): chooses the schema of this section and the code that builds it."""
    num_indexer_heads: int = 0
    """DeepSeek Sparse Attention indexer heads (0: dense attention)."""
    indexer_head_dim: int = 0
    """DeepSeek Sparse Attention indexer head width."""


limits(GlmMoeDsaConfig, num_indexer_heads=ge(0), indexer_head_dim=ge(0))


def arch(m: GlmMoeDsaConfig) -> Architecture:
    return Architecture(**arch_fields(m), num_indexer_heads=m.num_indexer_heads, indexer_head_dim=m.indexer_head_dim)


def check(cfg) -> None:
    check_deepseek_v3(cfg)
    positive("model.num_indexer_heads", cfg.model.num_indexer_heads, allow_zero=True)
    positive("model.indexer_head_dim", cfg.model.indexer_head_dim, allow_zero=True)


SPEC = MODELS.register(ModelSpec(
    name="glm_moe_dsa", config=GlmMoeDsaConfig, check=check, arch=arch, router_hook="forced_experts",
    summary="GLM-5 (MLA + DSA indexer + MoE): plan only"))
