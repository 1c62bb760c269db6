"""Registers model family ``qwen3_moe`` (transformers' Qwen3MoeForCausalLM; Qwen3-30B-A3B).

Torch-free at import: ``build`` / ``init`` import workers/models/qwen3_moe/model.py when called.
Parameter names are the checkpoint's, so ``to_hf`` / ``from_hf`` are the identity; config.json
maps through :data:`HF` (workers/models/hf_config.py), refusing sliding-window attention,
attention biases, rotary scaling and any key the model does not implement. The trainer shards
it with FSDP2, or with tp/ep the mesh plan (workers/trainer/parallel/mesh.py: DTensor TP attention with
replicated per-head q/k norms, TP dense MLPs, experts over EP); Router Replay forces the routed layers' experts.
"""
from __future__ import annotations

from workers.common.registry import MODELS
from workers.models.checks import check_gqa, check_moe, positive
from workers.models.facts import Architecture
from workers.models.hf_config import HfConfigMap
from workers.models.qwen3_moe.config import Qwen3MoeConfig
from workers.models.spec import ModelSpec

HF = HfConfigMap(
    family="qwen3_moe", architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe",
    fields={"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
            "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
            "max_position_embeddings": "max_position_embeddings", "rms_norm_eps": "rms_norm_eps",
            "tie_word_embeddings": "tie_word_embeddings", "num_experts": "num_experts",
            "num_experts_per_tok": "top_k", "moe_intermediate_size": "expert_intermediate_size",
            "norm_topk_prob": "norm_topk_prob", "decoder_sparse_step": "decoder_sparse_step",
            "mlp_only_layers": "mlp_only_layers", "intermediate_size": "dense_intermediate_size"},
    fixed={"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False, "attention_dropout": 0.0},
    # sliding_window / max_window_layers only act with use_sliding_window (refused above when on);
    # the aux-loss knobs are training options (ours: trainer.aux_loss_coef).
    inert=frozenset({"sliding_window", "max_window_layers", "router_aux_loss_coef", "output_router_logits"}),
    aliases={"num_local_experts": "num_experts"},
    # transformers' Qwen3MoeConfig values for absent keys (5.24), so a sparse config.json means what it means there.
    defaults={"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
              "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 0, "max_position_embeddings": 32768,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "num_experts": 128, "num_experts_per_tok": 8,
              "moe_intermediate_size": 768, "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []})


def to_hf_config(m: Qwen3MoeConfig) -> dict:
    out = HF.to_hf(m)
    out["head_dim"] = m.attention_head_dim  # transformers reads head_dim as is: 0 would mean 0
    out["num_key_value_heads"] = m.kv_heads
    return out


def from_hf_config(config: dict) -> dict:
    return HF.from_hf(config)


def build(model_cfg, *, device=None, dtype=None):
    from workers.models.qwen3_moe import model

    return model.build(model_cfg, device=device, dtype=dtype)


def init(model_cfg, dtype):
    from workers.models.qwen3_moe import model

    return model.init(model_cfg, dtype)


def arch(m: Qwen3MoeConfig) -> Architecture:
    return Architecture(vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers,
                        num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.attention_head_dim, qk_norm=True,
                        num_experts=m.num_experts, top_k=m.top_k, expert_intermediate_size=m.expert_intermediate_size,
                        num_dense_layers=m.num_layers - m.num_routed_layers,
                        dense_intermediate_size=m.dense_intermediate_size, tie_word_embeddings=m.tie_word_embeddings)


def check(cfg) -> None:
    """Plan time: the numbers of the config fit together (each message names the key and the numbers)."""
    m = cfg.model
    check_gqa(m)
    check_moe(m)
    if not m.head_dim and m.hidden_size % m.num_heads:
        raise ValueError(f"model.head_dim=0 means hidden_size/num_heads, but model.num_heads({m.num_heads}) does not "
                         f"divide model.hidden_size({m.hidden_size}); set model.head_dim")
    if m.attention_head_dim % 2:
        raise ValueError(f"model.head_dim({m.attention_head_dim}) must be even (rotary embedding)")
    bad = sorted(i for i in m.mlp_only_layers if not 0 <= i < m.num_layers)
    if bad:
        raise ValueError(f"model.mlp_only_layers has {bad}: layer indices must be in [0, model.num_layers({m.num_layers}))")
    if len(set(m.mlp_only_layers)) != len(m.mlp_only_layers):
        raise ValueError(f"model.mlp_only_layers={list(m.mlp_only_layers)} lists a layer twice")
    if m.num_routed_layers == 0:
        raise ValueError(f"model.decoder_sparse_step({m.decoder_sparse_step}) and model.mlp_only_layers="
                         f"{list(m.mlp_only_layers)} leave no MoE layer among model.num_layers({m.num_layers}); "
                         f"a dense model is model.family=llama")
    if m.num_routed_layers < m.num_layers:
        positive("model.dense_intermediate_size", m.dense_intermediate_size)


SPEC = MODELS.register(ModelSpec(
    name="qwen3_moe", config=Qwen3MoeConfig, check=check, arch=arch, build=build, init=init,
    router_hook="forced_experts", hf_architectures=(HF.architecture,), to_hf_config=to_hf_config,
    from_hf_config=from_hf_config,
    summary="Qwen3-MoE (q/k norms, free head_dim, GQA, norm_topk_prob, decoder_sparse_step / mlp_only_layers)"))
