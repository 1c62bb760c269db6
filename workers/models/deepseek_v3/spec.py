"""Registers model family ``deepseek_v3`` (DeepseekV3ForCausalLM: DeepSeek-V3, Kimi K2): plan only.

Multi-head latent attention (MLA), leading dense layers, routed + shared experts, optional MTP
layers. Nothing builds it here yet (``build`` is None): the plan counts its parameters and KV
bytes (workers/models/facts.py) and refuses to start it unless ``launcher.dry_run=true``.
"""
from __future__ import annotations

import dataclasses

from workers.common.config.model import ModelConfig
from workers.common.config.ranges import ge, gt, limits
from workers.common.registry import MODELS
from workers.models.checks import check_dense_layers, check_mla, check_moe
from workers.models.facts import Architecture
from workers.models.spec import ModelSpec


@dataclasses.dataclass(kw_only=True)
class DeepseekV3Config(ModelConfig):
    """MLA attention + MoE with shared experts and leading dense layers (HF DeepseekV3Config names
    in parentheses)."""

    family: str = "deepseek_v3"
    """Model family (workers/models registry): chooses the schema of this section and the code that builds it."""
    num_experts: int = 8
    """Routed experts per MoE layer (``n_routed_experts``)."""
    top_k: int = 2
    """Experts chosen per token (``num_experts_per_tok``)."""
    expert_intermediate_size: int = 256
    """Hidden width of each expert's SwiGLU MLP (``moe_intermediate_size``)."""
    num_shared_experts: int = 0
    """Always-active experts per MoE layer, besides the routed ones (``n_shared_experts``)."""
    num_dense_layers: int = 0
    """Leading layers with a dense MLP instead of MoE (``first_k_dense_replace``)."""
    dense_intermediate_size: int = 0
    """Hidden width of the dense layers' SwiGLU MLP (``intermediate_size``)."""
    q_lora_rank: int = 0
    """MLA: rank of the compressed query projection."""
    kv_lora_rank: int = 0
    """MLA: rank of the compressed key/value latent (what the KV cache stores)."""
    qk_nope_head_dim: int = 0
    """MLA: per-head query/key width without rotary embedding."""
    qk_rope_head_dim: int = 0
    """MLA: per-head query/key width with rotary embedding (shared key part)."""
    v_head_dim: int = 0
    """MLA: per-head value width."""
    num_mtp_layers: int = 0
    """Multi-token-prediction layers (not counted in the published parameter total)."""


limits(DeepseekV3Config, num_experts=gt(0), top_k=gt(0), expert_intermediate_size=gt(0), num_shared_experts=ge(0),
       num_dense_layers=ge(0), dense_intermediate_size=ge(0), q_lora_rank=gt(0), kv_lora_rank=gt(0),
       qk_nope_head_dim=gt(0), qk_rope_head_dim=gt(0), v_head_dim=gt(0), num_mtp_layers=ge(0))


def arch_fields(m: DeepseekV3Config) -> dict:
    """Architecture fields of a DeepSeek-V3-shaped config (glm_moe_dsa adds its indexer)."""
    return dict(vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads,
                num_experts=m.num_experts, top_k=m.top_k, expert_intermediate_size=m.expert_intermediate_size,
                num_shared_experts=m.num_shared_experts, num_dense_layers=m.num_dense_layers,
                dense_intermediate_size=m.dense_intermediate_size, attention="mla", q_lora_rank=m.q_lora_rank,
                kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, num_mtp_layers=m.num_mtp_layers)


def arch(m: DeepseekV3Config) -> Architecture:
    return Architecture(**arch_fields(m))


def check(cfg) -> None:
    m = cfg.model
    check_moe(m)
    check_mla(m)
    check_dense_layers(m)


SPEC = MODELS.register(ModelSpec(
    name="deepseek_v3", config=DeepseekV3Config, check=check, arch=arch, router_hook="forced_experts",
    summary="DeepSeek-V3 / Kimi K2 (MLA + MoE): plan only"))
