"""Registers model family ``tiny_moe`` (every layer a top-k routed MoE MLP; HF Qwen3-MoE names).

Torch-free at import: ``build`` and ``init`` import workers/models/tiny_moe/model.py when called.
The trainer shards it with FSDP2 at tp = ep = 1 (workers/trainer/parallel/fsdp.py, every family's default)
and with the mesh plan when tp or ep > 1 (workers/trainer/parallel/mesh.py: DTensor TP attention,
vocab-parallel embedding and lm_head, experts over EP); Router Replay forces experts through ``forced_experts``.
"""
from __future__ import annotations

from workers.common.registry import MODELS
from workers.models.checks import check_gqa, check_mha, check_moe
from workers.models.facts import Architecture
from workers.models.spec import ModelSpec
from workers.models.tiny_moe.config import TinyMoeConfig

"""The trainer's TP/EP plan of the tiny_moe/llama decoder (placement() by HF parameter name)."""


def build(model_cfg, *, device=None, dtype=None):
    from workers.models.tiny_moe import model

    return model.build(model_cfg, device=device, dtype=dtype)


def init(model_cfg, dtype):
    from workers.models.tiny_moe import model

    return model.init(model_cfg, dtype)


def arch(m: TinyMoeConfig) -> Architecture:
    return Architecture(vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers,
                        num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, num_experts=m.num_experts, top_k=m.top_k,
                        expert_intermediate_size=m.expert_intermediate_size,
                        tie_word_embeddings=m.tie_word_embeddings)


NOT_HF = ("native family tiny_moe; its published steps are NOT Hugging Face directories (plain safetensors + "
          "index.json, no config.json or tokenizer: its tensors carry Qwen3-MoE names, which transformers builds "
          "only with the q/k norms tiny_moe lacks); `python -m workers.weights.filesystem.resolve STEP OUT` writes "
          "a step as MixtralForCausalLM (the same function) with the byte tokenizer, and slurmrl-eval STEP serves "
          "steps as they are; for Hugging Face steps from the start train a checkpoint: model.path=DIR, or "
          "model=tiny_dense (LlamaForCausalLM)")
"""The plan's ``model path:`` line for this family (every run on the default model prints it)."""


def route(m: TinyMoeConfig) -> str:
    return NOT_HF


def check(cfg) -> None:
    m = cfg.model
    check_gqa(m)
    check_moe(m)
    check_mha(m)


SPEC = MODELS.register(ModelSpec(
    name="tiny_moe", config=TinyMoeConfig, check=check, arch=arch, build=build, init=init,
    router_hook="forced_experts", route_line=route, summary="small causal MoE decoder in plain torch (every layer top-k routed)"))
