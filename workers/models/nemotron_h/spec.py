"""Registers model family ``nemotron_h`` (Nemotron-H / Nemotron 3: hybrid Mamba-2, attention, dense
MLP and LatentMoE layers; transformers' NemotronHForCausalLM).

Torch-free at import: ``build`` / ``init`` import workers/models/nemotron_h/model.py when called.
Plan facts count each layer kind by what it holds (:class:`HybridArchitecture`); the KV cache
per token is the attention layers' only (a Mamba layer keeps a fixed-size state per sequence).
The trainer shards it with the generic plans: FSDP2 at tp = ep = 1, the mesh plan
(workers/trainer/parallel/mesh.py) otherwise, where its Mamba-2 mixers stay replicated over tp (attention,
MLP and shared experts are split; routed experts go over ep).
"""
from __future__ import annotations

import dataclasses

from workers.common.registry import MODELS
from workers.models.checks import check_moe, positive
from workers.models.facts import Architecture, ParamCount
from workers.models.nemotron_h.config import NemotronHConfig
from workers.models.nemotron_h.hf_config import ARCHITECTURES, from_hf_config, to_hf_config
from workers.models.spec import ModelSpec


@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridArchitecture(Architecture):
    """Architecture plus what a hybrid stack needs: the layer kinds and the Mamba/LatentMoE sizes.
    ``num_dense_layers`` is the count of non-MoE layers, so generic readers see the MoE layers."""

    pattern: str
    head_dim: int
    intermediate_size: int
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    mamba_n_groups: int
    conv_kernel: int
    shared_intermediate_size: int
    latent_size: int

    def expert_params(self) -> int:
        """One routed squared-ReLU expert (up and down) in the latent (or hidden) width."""
        return 2 * (self.latent_size or self.hidden_size) * self.expert_intermediate_size

    def attention_params(self) -> int:
        kv = (self.num_kv_heads or self.num_heads) * self.head_dim
        return 2 * self.hidden_size * self.num_heads * self.head_dim + 2 * self.hidden_size * kv

    def mamba_params(self) -> int:
        h, inner = self.hidden_size, self.mamba_num_heads * self.mamba_head_dim
        conv_dim = inner + 2 * self.mamba_n_groups * self.ssm_state_size
        in_proj = h * (inner + conv_dim + self.mamba_num_heads)
        return in_proj + conv_dim * (self.conv_kernel + 1) + 3 * self.mamba_num_heads + inner + inner * h

    def moe_params(self, experts: int) -> int:
        h = self.hidden_size
        latent = 2 * h * self.latent_size if self.latent_size else 0
        return self.num_experts * h + experts * self.expert_params() + 2 * h * self.shared_intermediate_size + latent

    def params(self) -> ParamCount:
        h = self.hidden_size
        per_kind = {"M": self.mamba_params(), "*": self.attention_params(), "-": 2 * h * self.intermediate_size}
        total = active = 0
        for kind in self.pattern:
            total += h + (self.moe_params(self.num_experts) if kind == "E" else per_kind[kind])
            active += h + (self.moe_params(self.top_k) if kind == "E" else per_kind[kind])
        embed = 2 * self.vocab_size * h + h  # untied embeddings and LM head, final norm
        # an MTP layer: an attention block and a MoE block, its input projection and norms
        mtp = self.num_mtp_layers * (self.attention_params() + self.moe_params(self.num_experts) + 2 * h * h + 4 * h)
        return ParamCount(total=total + embed, active=active + embed, mtp=mtp)

    def kv_bytes_per_token(self, dtype_bytes: float) -> int:
        kv = (self.num_kv_heads or self.num_heads) * self.head_dim
        return int(self.pattern.count("*") * 2 * kv * dtype_bytes)


def arch(m: NemotronHConfig) -> HybridArchitecture:
    return HybridArchitecture(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads, num_experts=m.num_experts, top_k=m.top_k,
        expert_intermediate_size=m.expert_intermediate_size, num_shared_experts=m.num_shared_experts,
        num_dense_layers=m.num_layers - m.num_routed_layers, num_mtp_layers=m.num_mtp_layers,
        pattern=m.hybrid_override_pattern, head_dim=m.attn_head_dim, intermediate_size=m.intermediate_size,
        mamba_num_heads=m.mamba_num_heads, mamba_head_dim=m.mamba_head_dim, ssm_state_size=m.ssm_state_size,
        mamba_n_groups=m.mamba_n_groups, conv_kernel=m.conv_kernel,
        shared_intermediate_size=m.shared_expert_intermediate_size, latent_size=m.moe_latent_size)


def check(cfg) -> None:
    m = cfg.model
    if len(m.hybrid_override_pattern) != m.num_layers:
        raise ValueError(f"model.num_layers({m.num_layers}) must equal len(model.hybrid_override_pattern)"
                         f"({len(m.hybrid_override_pattern)}): one layer kind per layer")
    if "E" in m.hybrid_override_pattern:
        check_moe(m)
    if m.num_kv_heads and m.num_heads % m.num_kv_heads:
        raise ValueError(f"model.num_kv_heads({m.num_kv_heads}) must divide model.num_heads({m.num_heads})")
    if not m.head_dim and m.hidden_size % m.num_heads:
        raise ValueError(f"model.num_heads({m.num_heads}) must divide model.hidden_size({m.hidden_size}) "
                         f"when model.head_dim=0")
    if m.mamba_num_heads % m.mamba_n_groups:
        raise ValueError(f"model.mamba_n_groups({m.mamba_n_groups}) must divide "
                         f"model.mamba_num_heads({m.mamba_num_heads})")
    if m.num_experts % m.n_group or m.topk_group > m.n_group:
        raise ValueError(f"model.n_group({m.n_group}) must divide model.num_experts({m.num_experts}) and be >= "
                         f"model.topk_group({m.topk_group})")
    if m.top_k > (m.num_experts // m.n_group) * m.topk_group:
        raise ValueError(f"model.top_k({m.top_k}) exceeds the experts of the kept groups: "
                         f"num_experts/n_group * topk_group = {(m.num_experts // m.n_group) * m.topk_group}")
    positive("model.time_step_max - model.time_step_min", m.time_step_max - m.time_step_min, allow_zero=True)


def from_hf(state: dict) -> dict:
    """Checkpoint names are ours, but the MTP layers (``mtp.*``) are not built: dropped, as
    transformers drops them on load (they stay in the source checkpoint, untrained)."""
    return {k: v for k, v in state.items() if not k.startswith("mtp.")}


def build(model_cfg, *, device=None, dtype=None):
    from workers.models.nemotron_h import model

    return model.build(model_cfg, device=device, dtype=dtype)


def init(model_cfg, dtype):
    from workers.models.nemotron_h import model

    return model.init(model_cfg, dtype)


SPEC = MODELS.register(ModelSpec(
    name="nemotron_h", config=NemotronHConfig, check=check, arch=arch, build=build, init=init,
    router_hook="forced_experts", from_hf=from_hf, hf_architectures=ARCHITECTURES, to_hf_config=to_hf_config,
    from_hf_config=from_hf_config,
    summary="Nemotron-H / Nemotron 3 (hybrid Mamba-2, attention, MLP, LatentMoE): builds, serves and trains "
            "(FSDP2; mesh plan with tp/ep, Mamba-2 replicated over tp)"))
