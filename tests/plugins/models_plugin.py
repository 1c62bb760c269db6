"""Test-only model family ``tiny_moe_scaled``: tiny_moe with one field of its own, ``init_scale``.

Registered from the test tree (no project file names it): importing this module registers the
family, which the launcher and every role do when ``SLURMRL_PLUGINS=tests.plugins.models_plugin``
(or ``plugins=[tests.plugins.models_plugin]``) is set. Then ``model=tiny_moe_scaled`` selects it
(a group option stored from the schema's defaults: tiny_moe.yaml's sizes), e.g.

    SLURMRL_PLUGINS=tests.plugins.models_plugin python -m launcher model=tiny_moe_scaled trainer.num_steps=2

Its schema is tiny_moe's plus ``init_scale``; its build reuses tiny_moe's torch code and its
seeded init is tiny_moe's with the standard deviation multiplied by ``init_scale`` (through the
config's ``init_std``), so the step-0 weights are exactly ``init_scale`` x tiny_moe's (norms stay 1).
"""
from __future__ import annotations

import dataclasses

from workers.common.registry import MODELS
from workers.models.checks import positive
from workers.models.spec import ModelSpec
from workers.models.tiny_moe import spec as tiny_moe
from workers.models.tiny_moe.config import INIT_STD, TinyMoeConfig

NAME = "tiny_moe_scaled"


@dataclasses.dataclass(kw_only=True)
class TinyMoeScaledConfig(TinyMoeConfig):
    """tiny_moe (hydra_conf/model/tiny_moe.yaml's sizes) whose seeded init is scaled by ``init_scale``."""

    family: str = NAME
    """Model family (workers/models registry): chooses the schema of this section and the code that builds it."""
    name: str = NAME
    """Preset name."""
    vocab_size: int = 16
    """Vocabulary size (the digit tasks: 4 specials + 10 digits, as tiny_moe.yaml)."""
    max_position_embeddings: int = 64
    """Longest sequence (as tiny_moe.yaml)."""
    init_scale: float = 0.5
    """Multiplies the standard deviation of the seeded init (> 0)."""

    @property
    def init_std(self) -> float:
        return INIT_STD * self.init_scale


def check(cfg) -> None:
    tiny_moe.check(cfg)
    positive("model.init_scale", cfg.model.init_scale)


def init(model_cfg: TinyMoeScaledConfig, dtype):
    """tiny_moe's seeded init (its std is the config's ``init_std``: scaled here)."""
    return tiny_moe.init(model_cfg, dtype)


SPEC = MODELS.register(ModelSpec(
    name=NAME, config=TinyMoeScaledConfig, check=check, arch=tiny_moe.arch, build=tiny_moe.build, init=init,
    router_hook="forced_experts", summary="test only: tiny_moe with a scaled init"))
