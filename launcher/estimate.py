"""Parameter counts and GPU memory estimates from the model's architecture facts.

Why: a plan for 28 nodes must show, before anything is submitted, that the trainer's states
and every inference replica's weights fit the GPUs they were given. These are first-order
estimates (weights, gradients, Adam states, KV-cache room), not a profiler: activations and
fragmentation are what the headroom is for. Pure arithmetic; no torch.
"""
from __future__ import annotations

import dataclasses

from workers.common.config import ModelConfig

TRAIN_BYTES_PER_PARAM = 16
"""bf16 weights (2) + bf16 grads (2) + fp32 master weights, Adam m and v (4 + 4 + 4)."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
SERVER_MEM_FRACTION = 0.9
"""Share of a GPU an inference server may use (SGLang's --mem-fraction-static is of this order)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamCount:
    total: int
    """Every parameter of the decoder layers and embeddings (the published figure; MTP excluded)."""
    active: int
    """Parameters used per token: routed experts count top_k times, not num_experts."""
    mtp: int
    """Parameters of the multi-token-prediction layers (on top of total)."""


def attention_params(m: ModelConfig) -> int:
    h = m.hidden_size
    if m.attention == "mha":  # q and o: h x h; k and v: h x (kv heads x head dim) under GQA
        kv = (m.num_kv_heads or m.num_heads) * (h // m.num_heads)
        return 2 * h * h + 2 * h * kv
    qk_head = m.qk_nope_head_dim + m.qk_rope_head_dim
    q = h * m.q_lora_rank + m.q_lora_rank * m.num_heads * qk_head + m.q_lora_rank  # down, up, norm
    kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank  # down (+ shared rope key), norm
    kv += m.kv_lora_rank * m.num_heads * (m.qk_nope_head_dim + m.v_head_dim)  # up to keys and values
    out = m.num_heads * m.v_head_dim * h
    indexer = 0
    if m.num_indexer_heads:  # DeepSeek Sparse Attention: query up, key, per-head weights
        indexer = (m.q_lora_rank * m.num_indexer_heads * m.indexer_head_dim + h * m.indexer_head_dim
                   + h * m.num_indexer_heads)
    return q + kv + out + indexer


def expert_params(m: ModelConfig) -> int:
    """One SwiGLU expert: gate, up and down projections."""
    return 3 * m.hidden_size * m.expert_intermediate_size


def count_params(m: ModelConfig) -> ParamCount:
    h = m.hidden_size
    attn = attention_params(m)
    router = h * m.num_experts
    moe_layer = attn + (m.num_experts + m.num_shared_experts) * expert_params(m) + router + 2 * h
    moe_active = attn + (m.top_k + m.num_shared_experts) * expert_params(m) + router + 2 * h
    dense_layer = attn + 3 * h * m.dense_intermediate_size + 2 * h
    num_dense = m.num_layers if m.num_experts == 0 else m.num_dense_layers  # num_experts=0: a dense model
    num_moe = m.num_layers - num_dense
    embed = (1 if m.tie_word_embeddings else 2) * m.vocab_size * h + h  # embedding (+ LM head), final norm
    total = num_moe * moe_layer + num_dense * dense_layer + embed
    active = num_moe * moe_active + num_dense * dense_layer + embed
    mtp = m.num_mtp_layers * (moe_layer + 2 * h * h + 2 * h)  # a MoE layer + its input projection, norms
    return ParamCount(total=total, active=active, mtp=mtp)


def kv_bytes_per_token(m: ModelConfig, dtype: str) -> int:
    """KV cache of one token over all layers: MLA stores the latent + rope key, MHA full K and V."""
    kv_width = (m.num_kv_heads or m.num_heads) * (m.hidden_size // m.num_heads)  # GQA: kv heads only
    per_layer = (m.kv_lora_rank + m.qk_rope_head_dim) if m.attention == "mla" else 2 * kv_width
    return m.num_layers * per_layer * DTYPE_BYTES[dtype]


def human(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.1f}{unit}"
    return str(int(n))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    what: str
    """Which role or replica kind."""
    per_gpu_gb: float
    """Estimated resident bytes per GPU, in GB."""
    gpu_gb: float
    """GPU memory available for it."""
    detail: str
    """One line: how the number was obtained and what remains."""

    @property
    def fits(self) -> bool:
        return self.per_gpu_gb <= self.gpu_gb


def trainer_memory(params: ParamCount, num_gpus: int, gpu_gb: float) -> MemoryEstimate:
    """States fully sharded over every trainer GPU (FSDP / distributed optimizer, experts over EP)."""
    per_gpu = (params.total + params.mtp) * TRAIN_BYTES_PER_PARAM / num_gpus / 1e9
    return MemoryEstimate(what="trainer", per_gpu_gb=per_gpu, gpu_gb=gpu_gb,
                          detail=f"{TRAIN_BYTES_PER_PARAM} B/param x {human(params.total + params.mtp)} params / "
                                 f"{num_gpus} GPUs = {per_gpu:.1f} GB/GPU of {gpu_gb:.0f} "
                                 f"({gpu_gb - per_gpu:.0f} GB left for activations)")


def server_memory(kind: str, m: ModelConfig, params: ParamCount, *, dtype: str, tp: int, gpu_gb: float) -> MemoryEstimate:
    """Weights of one replica split over its tp GPUs; what is left of the usable share is KV cache."""
    usable = gpu_gb * SERVER_MEM_FRACTION
    per_gpu = (params.total + params.mtp) * DTYPE_BYTES[dtype] / tp / 1e9
    kv_tokens = max(0.0, usable - per_gpu) * 1e9 * tp / kv_bytes_per_token(m, dtype)
    return MemoryEstimate(what=kind, per_gpu_gb=per_gpu, gpu_gb=usable,
                          detail=f"{dtype} weights {per_gpu:.1f} GB/GPU over tp {tp} of {usable:.0f} usable; "
                                 f"KV cache room ~{human(kv_tokens)} tokens per replica "
                                 f"({kv_bytes_per_token(m, dtype) / 1024:.1f} KiB/token)")
