"""Schema of model family ``nemotron_h`` (Nemotron-H / Nemotron 3: hybrid Mamba-2, attention, MLP
and LatentMoE layers) and its config.json mapping. Torch-free (the launcher imports it).

Every field names the transformers ``NemotronHConfig`` key it is written as (5.24). The layer
kinds are one character each, ``hybrid_override_pattern`` as the released checkpoints write it:
``M`` Mamba-2, ``*`` attention, ``-`` dense MLP, ``E`` MoE (transformers 5.x keeps the same list as
``layers_block_type`` of ``linear_attention`` / ``full_attention`` / ``mlp`` / ``moe``; config.json
gets both). Only ``E`` layers route, so ``num_routed_layers`` counts them.

:func:`from_hf_config` refuses a config.json key whose value this family does not implement
(naming it); keys that only matter to kernels or generation (``chunk_size``, token ids ...) pass.
"""
from __future__ import annotations

import dataclasses

from workers.common.config.model import ModelConfig
from workers.common.config.ranges import Pattern, between, ge, gt, limits

LAYER_KINDS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
"""Pattern character -> transformers 5.x ``layers_block_type`` name."""
LEGACY_KINDS = {"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}
"""Older checkpoints' list names (Nemotron-3.5 configs, transformers 4.x)."""


@dataclasses.dataclass(kw_only=True)
class NemotronHConfig(ModelConfig):
    family: str = "nemotron_h"
    """Model family (workers/models registry): chooses the schema of this section and the code that builds it."""
    hybrid_override_pattern: str = "ME*-"
    """Layer kinds in order (HF ``hybrid_override_pattern`` / ``layers_block_type``): M Mamba-2, * attention,
    - dense MLP, E MoE. Its length is ``num_layers`` (HF ``num_hidden_layers``)."""
    num_kv_heads: int = 0
    """Attention key/value heads (HF ``num_key_value_heads``); 0: num_heads. Must divide num_heads."""
    head_dim: int = 0
    """Attention head width (HF ``head_dim``); 0: hidden_size / num_heads."""
    intermediate_size: int = 256
    """Width of the dense ``-`` layers' squared-ReLU MLP (HF ``intermediate_size``)."""
    mamba_num_heads: int = 8
    """Mamba-2 heads (HF ``mamba_num_heads``); the mixer's inner width is heads x mamba_head_dim."""
    mamba_head_dim: int = 16
    """Mamba-2 head width (HF ``mamba_head_dim``)."""
    ssm_state_size: int = 16
    """Mamba-2 state size N per head (HF ``ssm_state_size``)."""
    mamba_n_groups: int = 2
    """Groups sharing B and C (HF ``n_groups``); must divide mamba_num_heads."""
    conv_kernel: int = 4
    """Causal conv1d width of the Mamba-2 mixer (HF ``conv_kernel``)."""
    use_conv_bias: bool = True
    """The conv1d has a bias (HF ``use_conv_bias``)."""
    time_step_min: float = 0.001
    """Floor of dt in full forwards (the reference's ``time_step_limit``) and low end of the dt_bias init
    (HF ``time_step_min``)."""
    time_step_max: float = 0.1
    """High end of the dt_bias init (HF ``time_step_max``)."""
    time_step_floor: float = 1e-4
    """Smallest initial dt (HF ``time_step_floor``)."""
    num_experts: int = 8
    """Routed experts per MoE layer (HF ``n_routed_experts``)."""
    top_k: int = 2
    """Experts chosen per token (HF ``num_experts_per_tok``)."""
    expert_intermediate_size: int = 128
    """Hidden width of each routed squared-ReLU expert (HF ``moe_intermediate_size``)."""
    shared_expert_intermediate_size: int = 256
    """Width of the always-active shared expert (HF ``moe_shared_expert_intermediate_size``)."""
    num_shared_experts: int = 1
    """Shared experts the shared width stands for (HF ``n_shared_experts``; the reference builds one MLP of
    the whole shared width, so this count changes nothing but the description)."""
    moe_latent_size: int = 0
    """LatentMoE width the routed experts work in (HF ``moe_latent_size``); 0: none (HF null)."""
    n_group: int = 1
    """Expert groups of the router's grouped top-k (HF ``n_group``)."""
    topk_group: int = 1
    """Groups kept per token (HF ``topk_group``)."""
    norm_topk_prob: bool = True
    """Renormalise the chosen experts' scores to sum 1 (HF ``norm_topk_prob``)."""
    routed_scaling_factor: float = 1.0
    """Multiplier of the routed experts' gate weights (HF ``routed_scaling_factor``)."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm (HF ``layer_norm_epsilon``)."""
    init_std: float = 0.02
    """Std of the seeded normal init (HF ``initializer_range``)."""
    num_mtp_layers: int = 0
    """Multi-token-prediction layers of the checkpoint (HF ``num_nextn_predict_layers``): counted in the
    plan, not built (their ``mtp.*`` weights are not loaded, as transformers ignores them)."""

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def attn_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def num_routed_layers(self) -> int:
        return self.hybrid_override_pattern.count("E")


limits(NemotronHConfig, hybrid_override_pattern=Pattern(r"[ME*\-]+", "layer kinds M, *, - or E"),
       num_kv_heads=ge(0), head_dim=ge(0), intermediate_size=gt(0), mamba_num_heads=gt(0), mamba_head_dim=gt(0),
       ssm_state_size=gt(0), mamba_n_groups=gt(0), conv_kernel=gt(0), time_step_min=gt(0), time_step_max=gt(0),
       time_step_floor=gt(0), num_experts=gt(0), top_k=gt(0), expert_intermediate_size=gt(0),
       shared_expert_intermediate_size=gt(0), num_shared_experts=ge(0), moe_latent_size=ge(0), n_group=gt(0),
       topk_group=gt(0), routed_scaling_factor=gt(0), norm_eps=between(0, 1, lo_open=True),
       init_std=between(0, 1, lo_open=True), num_mtp_layers=ge(0))
