"""Plan facts of a model family: parameter counts and KV-cache bytes, from one architecture view.

Why one view: the planner (launcher/estimate.py), the memory estimates and the simulator
(tools/simulator) count the same things for every family. Each family maps its own config onto
:class:`Architecture` (``ModelSpec.arch``), a flat, family-agnostic description in which a
feature the family lacks is 0 (a dense model has ``num_experts=0``; MHA has no MLA ranks), and
the counts below are written once. A family whose blocks these formulas do not describe (say a
state-space mixer with a fixed-size state) subclasses Architecture and overrides
:meth:`Architecture.params` / :meth:`Architecture.kv_bytes_per_token`.

Pure arithmetic; no torch (the launcher imports it on the login node).
"""
from __future__ import annotations

import dataclasses

from workers.common.registry import MODELS

DSA_CHUNK_PAIRS = 1 << 25
"""(query, key) pairs the context-parallel DSA path scores or masks at once (workers/models/blocks/
dsa_cp.py); here so that the planner (launcher/activations.py, no torch) counts the same."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamCount:
    total: int
    """Every parameter of the decoder layers and embeddings (the published figure; MTP excluded)."""
    active: int
    """Parameters used per token: routed experts count top_k times, not num_experts."""
    mtp: int
    """Parameters of the multi-token-prediction layers (on top of total)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Architecture:
    """What the counts need, in one vocabulary for every family (0 / ``mha``: feature absent)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    """Every decoder block (dense, MoE, or any other mixer the family has)."""
    num_heads: int
    num_kv_heads: int = 0
    """Grouped-query attention kv heads; 0: num_heads."""
    head_dim: int = 0
    """MHA head width; 0: hidden_size / num_heads (Qwen3 sets it apart from both)."""
    qk_norm: bool = False
    """Per-head RMSNorm of queries and keys (Qwen3): two ``[head_dim]`` weights per layer."""
    qkv_bias: bool = False
    """Biases on the q/k/v projections (Qwen2; GPT-OSS)."""
    o_bias: bool = False
    """A bias on the output projection (GPT-OSS; Qwen3's attention_bias sets both)."""
    attention_sinks: bool = False
    """One learned sink logit per query head and layer (GPT-OSS's ``self_attn.sinks``)."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0: a dense model (every layer a dense MLP)."""
    top_k: int = 0
    expert_intermediate_size: int = 0
    num_shared_experts: int = 0
    num_dense_layers: int = 0
    """Dense-MLP layers of a MoE model (DeepSeek's leading ones; Qwen3's mlp_only_layers and sparse step)."""
    dense_intermediate_size: int = 0
    tie_word_embeddings: bool = False
    attention: str = "mha"
    """``mha`` (q/k/v/o, GQA through num_kv_heads) or ``mla`` (multi-head latent attention)."""
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    num_indexer_heads: int = 0
    """DeepSeek Sparse Attention indexer heads (0: dense attention)."""
    indexer_head_dim: int = 0
    index_topk: int = 0
    """Keys each query keeps (DSA); the context-parallel path holds their indices, ``[T, index_topk]``."""
    num_mtp_layers: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers if self.is_moe else 0

    @property
    def mha_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def attention_params(self) -> int:
        h = self.hidden_size
        if self.attention == "mha":  # q and o: h x (heads x head dim); k and v: h x (kv heads x head dim) under GQA
            hd = self.mha_head_dim
            kv = (self.num_kv_heads or self.num_heads) * hd
            extras = ((2 * hd if self.qk_norm else 0) + (self.num_heads * hd + 2 * kv if self.qkv_bias else 0)
                      + (h if self.o_bias else 0) + (self.num_heads if self.attention_sinks else 0))
            return 2 * h * self.num_heads * hd + 2 * h * kv + extras
        qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank:
            q = h * self.q_lora_rank + self.q_lora_rank * self.num_heads * qk_head + self.q_lora_rank  # down, up, norm
        else:
            q = h * self.num_heads * qk_head  # one full q_proj
        kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank  # down (+ shared rope key), norm
        kv += self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)  # up to keys and values
        out = self.num_heads * self.v_head_dim * h
        indexer = 0
        if self.num_indexer_heads:  # DeepSeek Sparse Attention: query up, key (+ its LayerNorm), per-head weights
            indexer = (self.q_lora_rank * self.num_indexer_heads * self.indexer_head_dim + h * self.indexer_head_dim
                       + 2 * self.indexer_head_dim + h * self.num_indexer_heads)
        return q + kv + out + indexer

    def expert_params(self) -> int:
        """One SwiGLU expert: gate, up and down projections."""
        return 3 * self.hidden_size * self.expert_intermediate_size

    def params(self) -> ParamCount:
        h = self.hidden_size
        attn = self.attention_params()
        router = h * self.num_experts
        moe_layer = attn + (self.num_experts + self.num_shared_experts) * self.expert_params() + router + 2 * h
        moe_active = attn + (self.top_k + self.num_shared_experts) * self.expert_params() + router + 2 * h
        dense_layer = attn + 3 * h * self.dense_intermediate_size + 2 * h
        num_dense = self.num_layers - self.num_moe_layers
        embed = (1 if self.tie_word_embeddings else 2) * self.vocab_size * h + h  # embedding (+ LM head), final norm
        total = self.num_moe_layers * moe_layer + num_dense * dense_layer + embed
        active = self.num_moe_layers * moe_active + num_dense * dense_layer + embed
        mtp = self.num_mtp_layers * (moe_layer + 2 * h * h + 2 * h)  # a MoE layer + its input projection, norms
        return ParamCount(total=total, active=active, mtp=mtp)

    def kv_bytes_per_token(self, dtype_bytes: float) -> int:
        """KV cache of one token over all layers: MLA stores the latent + rope key, MHA full K and V."""
        kv_width = (self.num_kv_heads or self.num_heads) * self.mha_head_dim  # GQA: kv heads only
        per_layer = (self.kv_lora_rank + self.qk_rope_head_dim) if self.attention == "mla" else 2 * kv_width
        return int(self.num_layers * per_layer * dtype_bytes)


def architecture(model_cfg) -> Architecture:
    """The Architecture of a model section (any family, through its spec); an Architecture as is."""
    if isinstance(model_cfg, Architecture):
        return model_cfg
    return MODELS.get(model_cfg.family).arch(model_cfg)
