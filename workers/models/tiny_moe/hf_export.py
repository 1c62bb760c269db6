"""tiny_moe as Hugging Face's Mixtral: the names and config.json that make a tiny_moe step a
``MixtralForCausalLM`` directory (torch-free).

tiny_moe computes Mixtral's function exactly (GQA attention without q/k norms, head_dim =
hidden/heads, rotary, RMSNorm, every layer a softmax top-k router over SwiGLU experts with the
top-k weights renormalised, no shared expert, no biases); only its tensor names are Qwen3-MoE's,
which transformers builds with q/k norms. Published steps keep our names (every worker, the
trainer's sharding plan and LoRA read them); ``python -m workers.weights.filesystem.resolve STEP
OUT`` renames them into Mixtral's original checkpoint layout (``block_sparse_moe.experts.E.w1/w2/w3``,
what transformers and SGLang both read) and writes this config.json beside them.
"""
from __future__ import annotations

import re

EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
W = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def mixtral_name(name: str) -> str:
    """Our parameter name -> Mixtral's (``model.layers.0.mlp.experts.3.up_proj.weight`` ->
    ``model.layers.0.block_sparse_moe.experts.3.w3.weight``; the router ``mlp.gate`` too)."""
    name = EXPERT.sub(lambda m: f".block_sparse_moe.experts.{m[1]}.{W[m[2]]}.weight", name)
    return name.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")


def mixtral_config(m) -> dict:
    """config.json of a tiny_moe model (workers/models/tiny_moe/config.py TinyMoeConfig) as Mixtral."""
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": m.vocab_size,
            "hidden_size": m.hidden_size, "intermediate_size": m.expert_intermediate_size,
            "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
            "num_key_value_heads": m.kv_heads, "head_dim": m.head_dim, "num_local_experts": m.num_experts,
            "num_experts_per_tok": m.top_k, "rms_norm_eps": m.rms_norm_eps, "rope_theta": float(m.rope_theta), "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": float(m.rope_theta)},
            "max_position_embeddings": m.max_position_embeddings, "tie_word_embeddings": m.tie_word_embeddings,
            "hidden_act": "silu", "sliding_window": None, "router_jitter_noise": 0.0, "attention_dropout": 0.0,
            "output_router_logits": False}
