"""The model shapes the benchmarks compare ours and transformers at, and the FLOPs of a training step.

    tiny_configs()   every family, small enough for 2 CPU cores (model_parity's default, its error checks)
    gpu_configs()    ~1B-class MoE configs (model_parity --size 1b)
    real_configs()   real MoE / dense layer widths and vocabularies (model_parity --size real,
                     benchmarks/gpu/bench_real_step.py, bench_lora_step.py, profile_model_parity.py)

Why a module of its own: these configs and :func:`train_flops_per_token` (the MFU numerator) are
what several benchmarks share so that their rows are of one model; model_parity.py is the
comparison that runs them. Each config is ``family -> (transformers model_type, config kwargs)``.
"""
from __future__ import annotations

import torch

MOE_1B = dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, vocab_size=32000)
"""~1.5B-parameter MoE shapes for the GPU comparison (the tiny_moe gpu_moe_1b5 preset's scale)."""


def tiny_configs() -> dict[str, tuple[str, dict]]:
    """family -> (transformers model_type, config kwargs): small enough for 2 CPU cores, every block used."""
    mla = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
               num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, kv_lora_rank=16,
               q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, first_k_dense_replace=1,
               max_position_embeddings=512, tie_word_embeddings=False)
    return {
        "llama": ("llama", dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)),
        "qwen3_moe": ("qwen3_moe", dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                        max_position_embeddings=512)),
        "deepseek_v3": ("deepseek_v3", {**mla, "num_nextn_predict_layers": 0}),
        "glm_moe_dsa": ("glm_moe_dsa", {**mla, "index_topk": 16, "index_head_dim": 16, "index_n_heads": 4}),
        "nemotron_h": ("nemotron_h", dict(vocab_size=256, hidden_size=64, layers_block_type=[
            "linear_attention", "moe", "full_attention", "mlp"], num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=96, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
            conv_kernel=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=64, moe_latent_size=32, n_shared_experts=1, n_group=2, topk_group=1,
            routed_scaling_factor=2.5, max_position_embeddings=512)),
        "qwen3": ("qwen3", dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=512)),
        "qwen2": ("qwen2", dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)),
        "mistral": ("mistral", dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=24,
                                    max_position_embeddings=512)),
        "gemma3_text": ("gemma3_text", dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                            sliding_window=24, query_pre_attn_scalar=16,
                                            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                            max_position_embeddings=512)),
        "gpt_oss": ("gpt_oss", dict(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                                    num_experts_per_tok=2, sliding_window=24,
                                    layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512)),
    }


def gpu_configs() -> dict[str, tuple[str, dict]]:
    """~1B-class configs of the two families the issue names for the GPU ratio."""
    return {
        "qwen3_moe": ("qwen3_moe", dict(**MOE_1B, intermediate_size=4096, moe_intermediate_size=512, num_key_value_heads=4,
                                        head_dim=64, num_experts=32, num_experts_per_tok=4, norm_topk_prob=True,
                                        max_position_embeddings=8192)),
        "deepseek_v3": ("deepseek_v3", dict(**MOE_1B, intermediate_size=4096, moe_intermediate_size=512,
                                            num_key_value_heads=16, n_shared_experts=1, n_routed_experts=32,
                                            num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                            kv_lora_rank=256, q_lora_rank=512, qk_rope_head_dim=32, qk_nope_head_dim=64,
                                            v_head_dim=64, first_k_dense_replace=1, max_position_embeddings=8192,
                                            num_nextn_predict_layers=0)),
    }


def real_configs() -> dict[str, tuple[str, dict]]:
    """The shapes real MoE models use (``"shape": "real"`` rows): 128 experts, top-8, a 152k (Qwen3) and
    a 164k (Kimi-K2) vocabulary, Qwen3-30B-A3B's and DeepSeek-V3's per-layer widths at hidden 2048,
    and few layers (the head, the dispatch and one layer of each kind are what the rows compare)."""
    return {
        "qwen3_moe": ("qwen3_moe", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                        moe_intermediate_size=768, num_hidden_layers=2, num_attention_heads=32,
                                        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                        norm_topk_prob=True, max_position_embeddings=8192)),
        "deepseek_v3": ("deepseek_v3", dict(vocab_size=163840, hidden_size=2048, intermediate_size=6144,
                                            moe_intermediate_size=768, num_hidden_layers=3, num_attention_heads=16,
                                            num_key_value_heads=16, n_shared_experts=1, n_routed_experts=128,
                                            num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                                            kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                                            qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=1,
                                            max_position_embeddings=8192, num_nextn_predict_layers=0)),
        # Qwen3-8B's layer (hidden 4096, 32 heads over 8 kv heads of 128, SwiGLU 12288, 152k vocabulary, untied)
        "qwen3": ("qwen3", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=3,
                                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                                max_position_embeddings=8192)),
        # GPT-OSS-20B's MoE layer (32 experts top-4 of width 2880, 64 heads of 64 over 8 kv heads with sinks and
        # biases, a 128-token window, 201k vocabulary): one (sliding) layer, so four models fit one 80 GB card
        "gpt_oss": ("gpt_oss", dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=1,
                                    num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                                    num_experts_per_tok=4, sliding_window=128, layer_types=["sliding_attention"],
                                    max_position_embeddings=8192)),
    }


def train_flops_per_token(model: torch.nn.Module, kw: dict, seq: int) -> float:
    """Model FLOPs per trained token (forward + backward): ``6 x`` the parameters a token multiplies by
    (routed experts counted ``top_k / E``, the embedding lookup not at all, the head in full) plus the
    causal attention scores and values, ``6 x L x heads x (d_qk + d_v) x seq / 2``."""
    from workers.models.blocks.experts import StackedExperts

    active = 0.0
    expert_params = {id(p) for m in model.modules() if isinstance(m, StackedExperts) for p in m.parameters()}
    top_k = kw.get("num_experts_per_tok", 1)
    num_experts = kw.get("num_experts") or kw.get("n_routed_experts") or kw.get("num_local_experts") or 1
    for name, p in model.named_parameters():
        if "embed_tokens" in name and model.lm_head is not None:
            continue
        routed = id(p) in expert_params or ".mlp.experts." in name  # GPT-OSS keeps transformers' fused experts
        active += p.numel() * (top_k / num_experts if routed else 1.0)
    heads = kw["num_attention_heads"]
    if "kv_lora_rank" in kw:
        d_qk, d_v = kw["qk_nope_head_dim"] + kw["qk_rope_head_dim"], kw["v_head_dim"]
    else:
        d_qk = d_v = kw.get("head_dim") or kw["hidden_size"] // heads
    window = kw.get("sliding_window") or seq
    types = kw.get("layer_types") or ["sliding_attention" if "sliding_window" in kw else "full_attention"] * kw[
        "num_hidden_layers"]
    keys = sum(min(window, seq) * (1 - min(window, seq) / (2 * seq)) if t == "sliding_attention" else seq / 2
               for t in types)  # mean keys a query sees, summed over layers (a window caps them)
    attn = 6.0 * heads * (d_qk + d_v) * keys
    return 6.0 * active + attn


H200_BF16_PEAK = 989e12
"""Dense bf16 peak of one H200 (the MFU denominator, as benchmarks/gpu/common.py)."""


def shrink_real_configs() -> None:
    """``--toy``: the real-shape rows' code path at CPU widths (the GPU command's smoke test): from now on
    :func:`real_configs` (read as ``model_shapes.real_configs()``, at call time) returns the cut widths."""
    full = real_configs()
    cut = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
               num_experts=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, kv_lora_rank=16,
               q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, head_dim=16)
    small = {f: (t, {k: cut.get(k, v) for k, v in kw.items()}) for f, (t, kw) in full.items()}
    for _, kw in small.values():
        kw["num_key_value_heads"] = min(kw["num_key_value_heads"], kw["num_attention_heads"])
    globals()["real_configs"] = lambda: small
