"""Schema of model family ``deepseek_v3`` (DeepseekV3ForCausalLM: DeepSeek-V3, Kimi-K2.x). Torch-free.

Every field names the config.json key it mirrors (workers/models/deepseek_v3/hf_config.py maps
them both ways). glm_moe_dsa (GLM-5) subclasses it with the sparse-attention indexer.
"""
from __future__ import annotations

import dataclasses

from workers.common.config.model import ModelConfig
from workers.common.config.ranges import ge, gt, limits, one_of


@dataclasses.dataclass(kw_only=True)
class DeepseekV3Config(ModelConfig):
    """MLA attention + sigmoid-routed MoE with shared experts and leading dense layers."""

    family: str = "deepseek_v3"
    """Model family (workers/models registry): chooses the schema of this section and the code that builds it."""
    num_experts: int = 8
    """Routed experts per MoE layer (``n_routed_experts``)."""
    top_k: int = 2
    """Experts chosen per token (``num_experts_per_tok``)."""
    expert_intermediate_size: int = 256
    """Hidden width of each expert's SwiGLU MLP (``moe_intermediate_size``)."""
    num_shared_experts: int = 0
    """Always-active experts per MoE layer, besides the routed ones (``n_shared_experts``); stored as
    one SwiGLU of width ``num_shared_experts * expert_intermediate_size``."""
    num_dense_layers: int = 0
    """Leading layers with a dense MLP instead of MoE (``first_k_dense_replace``): no router, so no
    column in routed-expert records."""
    dense_intermediate_size: int = 0
    """Hidden width of the dense layers' SwiGLU MLP (``intermediate_size``)."""
    num_expert_groups: int = 1
    """Expert groups of the grouped top-k router (``n_group``): experts are chosen only from the
    ``topk_groups`` best groups."""
    topk_groups: int = 1
    """Groups kept per token (``topk_group``)."""
    routed_scaling_factor: float = 1.0
    """Multiplies the routed experts' gate weights (``routed_scaling_factor``)."""
    norm_topk_prob: bool = True
    """Renormalise the chosen experts' sigmoid scores to sum 1 before scaling (``norm_topk_prob``)."""
    q_lora_rank: int = 0
    """MLA: rank of the compressed query projection (``q_lora_rank``); 0: a full ``q_proj`` (config.json null)."""
    kv_lora_rank: int = 0
    """MLA: rank of the compressed key/value latent, what the KV cache stores (``kv_lora_rank``)."""
    qk_nope_head_dim: int = 0
    """MLA: per-head query/key width without rotary embedding (``qk_nope_head_dim``)."""
    qk_rope_head_dim: int = 0
    """MLA: per-head query/key width with rotary embedding, the key part shared by heads (``qk_rope_head_dim``)."""
    v_head_dim: int = 0
    """MLA: per-head value width (``v_head_dim``)."""
    num_mtp_layers: int = 0
    """Multi-token-prediction layers of the checkpoint (``num_nextn_predict_layers``): counted by the
    plan, not built; their weights (``model.layers.{num_layers}...``) are skipped on load."""
    rope_theta: float = 10000.0
    """Rotary base (``rope_theta``; ``rope_parameters.rope_theta`` in transformers 5.x)."""
    rope_interleave: bool = True
    """Rotary channels in interleaved pairs, DeepSeek's original layout (``rope_interleave``)."""
    rope_scaling: str = "default"
    """``default`` or ``yarn`` (``rope_scaling.type`` / ``rope_parameters.rope_type``)."""
    rope_factor: float = 1.0
    """YaRN context extension factor (``rope_scaling.factor``)."""
    rope_original_max_position_embeddings: int = 4096
    """YaRN: the pre-training context (``rope_scaling.original_max_position_embeddings``)."""
    rope_beta_fast: float = 32.0
    """YaRN ramp boundary, rotations (``rope_scaling.beta_fast``)."""
    rope_beta_slow: float = 1.0
    """YaRN ramp boundary, rotations (``rope_scaling.beta_slow``)."""
    rope_mscale: float = 0.0
    """YaRN magnitude scale of cos/sin (``rope_scaling.mscale``); 0: absent."""
    rope_mscale_all_dim: float = 0.0
    """YaRN magnitude scale of cos/sin and of MLA's softmax scale (``rope_scaling.mscale_all_dim``); 0: absent."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon of the layer and final norms (``rms_norm_eps``)."""
    tie_word_embeddings: bool = False
    """The output projection is the input embedding (``tie_word_embeddings``)."""

    @property
    def num_routed_layers(self) -> int:
        """The MoE layers (after the ``num_dense_layers`` dense ones): the routing records' layer axis."""
        return self.num_layers - self.num_dense_layers

    @property
    def init_std(self) -> float:
        """Std of the seeded init (transformers' ``initializer_range`` default)."""
        return 0.02


limits(DeepseekV3Config, num_experts=gt(0), top_k=gt(0), expert_intermediate_size=gt(0), num_shared_experts=ge(0),
       num_dense_layers=ge(0), dense_intermediate_size=ge(0), num_expert_groups=gt(0), topk_groups=gt(0),
       routed_scaling_factor=gt(0), q_lora_rank=ge(0), kv_lora_rank=gt(0), qk_nope_head_dim=gt(0),
       qk_rope_head_dim=gt(0), v_head_dim=gt(0), num_mtp_layers=ge(0), rope_theta=gt(0),
       rope_scaling=one_of("default", "yarn"), rope_factor=ge(1), rope_original_max_position_embeddings=gt(0),
       rope_beta_fast=gt(0), rope_beta_slow=gt(0), rope_mscale=ge(0), rope_mscale_all_dim=ge(0),
       rms_norm_eps=gt(0))


def rope_of(m: DeepseekV3Config):
    """The model's :class:`workers.models.blocks.rope_scaled.Rope` (imports torch code)."""
    from workers.models.blocks.rope_scaled import Rope

    return Rope(dim=m.qk_rope_head_dim, theta=m.rope_theta, scaling=m.rope_scaling, factor=m.rope_factor,
                original_max_position_embeddings=m.rope_original_max_position_embeddings,
                beta_fast=m.rope_beta_fast, beta_slow=m.rope_beta_slow, mscale=m.rope_mscale,
                mscale_all_dim=m.rope_mscale_all_dim)
