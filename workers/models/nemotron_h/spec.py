"""Registers model family ``nemotron_h`` (NemotronH: Nemotron 3 Ultra): plan only.

A hybrid of Mamba-2, attention and LatentMoE blocks. The plan's equivalents (what the preset
YAML explains): every block counts as an MHA attention block plus a MoE MLP whose expert width
reproduces the published totals; the KV bytes are those of MHA over every block (an
overestimate: Mamba blocks keep a fixed-size state). Refused outside ``launcher.dry_run=true``.
"""
from __future__ import annotations

import dataclasses

from workers.common.config.model import ModelConfig
from workers.common.config.ranges import ge, gt, limits
from workers.common.registry import MODELS
from workers.models.checks import check_mha, check_moe
from workers.models.facts import Architecture
from workers.models.spec import ModelSpec


@dataclasses.dataclass(kw_only=True)
class NemotronHConfig(ModelConfig):
    family: str = "nemotron_h"
    """Model family (workers/models registry): chooses the schema of this section and the code that builds it."""
    num_experts: int = 8
    """Routed experts per MoE block."""
    top_k: int = 2
    """Experts chosen per token."""
    expert_intermediate_size: int = 256
    """Equivalent hidden width of each expert (3 x hidden x this = one expert's parameters)."""
    num_shared_experts: int = 0
    """Always-active experts per MoE block, besides the routed ones."""
    num_mtp_layers: int = 0
    """Multi-token-prediction layers (not counted in the published parameter total)."""


limits(NemotronHConfig, num_experts=gt(0), top_k=gt(0), expert_intermediate_size=gt(0), num_shared_experts=ge(0),
       num_mtp_layers=ge(0))


def arch(m: NemotronHConfig) -> Architecture:
    return Architecture(vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers,
                        num_heads=m.num_heads, num_experts=m.num_experts, top_k=m.top_k,
                        expert_intermediate_size=m.expert_intermediate_size, num_shared_experts=m.num_shared_experts,
                        num_mtp_layers=m.num_mtp_layers)


def check(cfg) -> None:
    check_moe(cfg.model)
    check_mha(cfg.model)


SPEC = MODELS.register(ModelSpec(
    name="nemotron_h", config=NemotronHConfig, check=check, arch=arch, router_hook="forced_experts",
    summary="Nemotron 3 Ultra (hybrid Mamba/attention + LatentMoE): plan only"))
