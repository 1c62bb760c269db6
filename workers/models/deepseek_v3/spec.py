"""Registers model family ``deepseek_v3`` (DeepseekV3ForCausalLM: DeepSeek-V3, Kimi-K2.x).

Multi-head latent attention (MLA, YaRN rotary), leading dense layers, sigmoid grouped top-k
routed experts with shared experts (workers/models/deepseek_v3/model.py, from
workers/models/blocks/). The embedded engine serves it (latent KV cache); the trainer shards it with
the generic plans (FSDP2 at tp = ep = 1; workers/trainer/parallel/mesh.py with tp or ep > 1: MLA heads
split over tp, experts over ep). Multi-token-prediction layers are counted by the plan but not
built (their checkpoint weights are skipped on load).
"""
from __future__ import annotations

from workers.common.registry import MODELS
from workers.models.checks import check_dense_layers, check_mla, check_moe, check_sigmoid_router
from workers.models.deepseek_v3 import hf_config
from workers.models.deepseek_v3.config import DeepseekV3Config
from workers.models.facts import Architecture
from workers.models.spec import ModelSpec

__all__ = ["DeepseekV3Config", "SPEC", "arch_fields"]


def build(model_cfg, *, device=None, dtype=None):
    from workers.models.deepseek_v3 import model

    return model.build(model_cfg, device=device, dtype=dtype)


def init(model_cfg, dtype):
    from workers.models.deepseek_v3 import model

    return model.init(model_cfg, dtype)


def arch_fields(m: DeepseekV3Config) -> dict:
    """Architecture fields of a DeepSeek-V3-shaped config (glm_moe_dsa adds its indexer)."""
    return dict(vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads,
                num_experts=m.num_experts, top_k=m.top_k, expert_intermediate_size=m.expert_intermediate_size,
                num_shared_experts=m.num_shared_experts, num_dense_layers=m.num_dense_layers,
                dense_intermediate_size=m.dense_intermediate_size, attention="mla", q_lora_rank=m.q_lora_rank,
                kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, num_mtp_layers=m.num_mtp_layers,
                tie_word_embeddings=m.tie_word_embeddings)


def arch(m: DeepseekV3Config) -> Architecture:
    return Architecture(**arch_fields(m))


def check(cfg) -> None:
    m = cfg.model
    check_moe(m)
    check_mla(m)
    check_dense_layers(m)
    check_sigmoid_router(m)


SPEC = MODELS.register(ModelSpec(
    name="deepseek_v3", config=DeepseekV3Config, check=check, arch=arch, build=build, init=init,
    router_hook="forced_experts", not_built=hf_config.is_mtp, hf_architectures=("DeepseekV3ForCausalLM",),
    to_hf_config=hf_config.to_hf_config, from_hf_config=hf_config.from_hf_config,
    summary="DeepSeek-V3 / Kimi-K2 (MLA + sigmoid-routed MoE; MTP layers counted, not built; trains under "
            "FSDP2 or the tp/ep mesh plan)"))
