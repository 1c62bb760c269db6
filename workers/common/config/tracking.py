"""Tracking section: experiment trackers beside metrics.jsonl and TensorBoard (workers/trainer/tracking.py)."""
from __future__ import annotations

import dataclasses

from workers.common.config.ranges import TEXT, limits, one_of


@dataclasses.dataclass(kw_only=True)
class TrackingConfig:
    wandb: bool = False
    """Log every metrics.jsonl record to Weights & Biases too (trainer rank 0; needs ``pip install wandb``)."""
    wandb_mode: str = "offline"
    """``offline`` (default: clusters often have no internet; ``wandb sync run_dir/wandb/...`` later) or ``online``."""
    wandb_project: str = ""
    """W&B project; "" uses ``slurmrl-<experiment>`` (a bring-your-own run of the default bundle:
    ``slurmrl-<model>-<env>``, the launcher's run label)."""
    wandb_entity: str = ""
    """W&B entity (team or user); "" for the default one."""


limits(TrackingConfig, wandb_mode=one_of("offline", "online"), wandb_project=TEXT, wandb_entity=TEXT)
