"""A test-only weight transport, ``damaged_patches``: the filesystem transport with patches damaged on purpose.

Registered from the test tree only (``SLURMRL_PLUGINS=tests.plugins.damaged_weights_plugin``, then
``weights=damaged_patches``). Everything is the filesystem transport's (orchestrator and workers use its
coordinator and receiver, unchanged); only the trainer's patch publisher damages chosen patch steps before
they are renamed into place, so the orchestrator can never load them intact (a copy damaged after the
rename races the orchestrator's next loop turn). ``weights.damage`` lists kinds in order; each damages
the first patch step at least ``weights.damage_gap`` versions after the previous damaged one, once the
trainer has answered that one with an anchor out of turn (so every kind is refused on its own):

    flip      one byte of the patch file flipped (its part's xxh3 fails)
    truncate  the patch file cut to half its size
    delete    the patch file removed (index.json still names it)
    index     index.json replaced by bytes that are not JSON
    base      index.json's ``base`` set one version too far back (needs base > anchor)

Each damaged step is recorded in ``run_dir/weights_damaged.jsonl`` ({version, kind}) for the test.
This module is torch-free (the launcher imports it through SLURMRL_PLUGINS).
"""
from __future__ import annotations

import dataclasses

from workers.common.registry import TRANSPORTS
from workers.weights.delta.config import DeltaWeightsConfig
from workers.weights.filesystem import check as filesystem_check
from workers.weights.spec import TransportSpec, lazy

NAME = "damaged_patches"
KINDS = ("flip", "truncate", "delete", "index", "base")


@dataclasses.dataclass(kw_only=True)
class DamagedPatchesConfig(DeltaWeightsConfig):
    """``weights=damaged_patches``: the filesystem transport's fields plus what to damage."""

    transport: str = NAME
    """``damaged_patches``: this schema's transport."""
    delta: bool = True
    """Patch steps (what this transport damages)."""
    damage: str = ",".join(KINDS)
    """Comma-separated kinds (module docstring), applied in this order."""
    damage_gap: int = 3
    """Versions at least between two damaged steps (the run recovers from one before the next)."""


def check(cfg) -> None:
    filesystem_check(cfg)
    bad = [k for k in cfg.weights.damage.split(",") if k and k not in KINDS]
    if bad or cfg.weights.damage_gap < 1:
        raise ValueError(f"weights.damage: kinds from {KINDS} (got {bad}); weights.damage_gap >= 1")


SPEC = TRANSPORTS.register(TransportSpec(
    name=NAME, config=DamagedPatchesConfig, check=check,
    summary="test-only: the filesystem transport with chosen patch steps damaged before they appear",
    publisher=lazy("tests.plugins.damaged_weights_roles:make_publisher"),
    coordinator=lazy("workers.weights.filesystem.coordinator:make_coordinator"),
    receiver=lazy("workers.weights.filesystem.receiver:make_receiver")), replace=True)
