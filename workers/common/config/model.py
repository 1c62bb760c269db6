"""Model section: architecture facts of the policy model (``model/`` Hydra group)."""
from __future__ import annotations

import dataclasses

from omegaconf import MISSING


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    family: str = "tiny_moe"
    """Model family (workers/models registry): chooses the schema of this section and the code that builds it."""
    name: str = MISSING
    """Preset name."""
    vocab_size: int = MISSING
    """Vocabulary size; must cover the environment's tokenizer."""
    hidden_size: int = 128
    """Residual stream width."""
    num_layers: int = 4
    """Decoder layers (every one is MoE, or every one dense when num_experts=0)."""
    num_heads: int = 4
    """Attention heads; must divide hidden_size."""
    num_kv_heads: int = 0
    """Key/value heads (grouped-query attention, Llama's ``num_key_value_heads``); 0: num_heads.
    Must divide num_heads."""
    num_experts: int = 8
    """Routed experts per MoE layer; 0 makes a dense model (every layer a SwiGLU MLP of
    dense_intermediate_size, no router: Router Replay and routed experts do not apply)."""
    top_k: int = 2
    """Experts chosen per token (0 for a dense model)."""
    expert_intermediate_size: int = 256
    """Hidden width of each expert's SwiGLU MLP."""
    max_position_embeddings: int = 512
    """Longest sequence (prompt + completion) the model accepts."""
    init_seed: int = 1234
    """Seed of the deterministic initial weights (step 0)."""
    num_dense_layers: int = 0
    """Leading layers with a dense MLP instead of MoE (DeepSeek/GLM ``first_k_dense_replace``)."""
    dense_intermediate_size: int = 0
    """Hidden width of the dense layers' SwiGLU MLP (num_dense_layers > 0, or num_experts=0)."""
    tie_word_embeddings: bool = False
    """The output projection is the input embedding (no ``lm_head.weight`` of its own)."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    pretrained: str = ""
    """Start from a pretrained checkpoint instead of the seeded init: a name of
    workers/modeling/pretrained.py SOURCES (``smollm2_135m``); "" = random init from init_seed."""
    pretrained_dir: str = ""
    """Where the converted checkpoint (safetensors + tokenizer) lives; "" lets the launcher pin
    $SLURMRL_CACHE (default ~/.cache/slurmrl)/pretrained/<pretrained>. Must be visible to every node."""
    num_shared_experts: int = 0
    """Always-active experts per MoE layer, besides the routed ones."""
    attention: str = "mha"
    """``mha`` (q/k/v/o projections of hidden x hidden) or ``mla`` (multi-head latent attention)."""
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
    num_indexer_heads: int = 0
    """DeepSeek Sparse Attention indexer heads (0: dense attention)."""
    indexer_head_dim: int = 0
    """DeepSeek Sparse Attention indexer head width."""
    num_mtp_layers: int = 0
    """Multi-token-prediction layers (not counted in the published parameter total)."""
