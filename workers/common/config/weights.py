"""Weights section: how trained weights reach inference (``weights/`` Hydra group).

This is the part every transport reads; each transport's package subclasses it with its
own fields (workers/weights/delta/config.py: DeltaWeightsConfig, which the filesystem and broadcast
transports extend), and ``weights.transport`` picks the schema.
"""
from __future__ import annotations

import dataclasses

from workers.common.config.ranges import NONEMPTY, ge, gt, limits


@dataclasses.dataclass(kw_only=True)
class WeightsConfig:
    transport: str = "filesystem"
    """The transport package (workers/weights/<name>): ``filesystem`` (run_dir/weights/step_N),
    ``broadcast`` (torch.distributed), or a plugin's."""
    keep_last: int = 3
    """Published weight steps kept on disk (older ones are deleted, unless a kept delta step
    still points at their files); at least 2, so a step being loaded is never pruned."""
    skip_nonfinite: bool = False
    """A step whose weights hold NaN or inf is never published (found in the checksum pass). False:
    the trainer stops with an error naming the tensor and the step (exit EXIT_FATAL: not restarted).
    True: the trainer restores its newest checkpoint instead (saving one before step 1 when there
    is none), warns, and publishes that finite state as the step's version; after
    ``max_nonfinite_skips`` such steps it stops with the reason (workers/trainer/divergence.py).
    The steps since that checkpoint are lost: keep trainer.checkpoint_every_steps small."""
    max_nonfinite_skips: int = 3
    """With ``skip_nonfinite``: non-finite steps skipped (each restoring the newest checkpoint) with
    no clean checkpoint in between before the run counts as diverged and the trainer stops."""
    num_hash_threads: int = 2
    """Threads that checksum tensors while they are written, read or broadcast."""
    verify: bool = False
    """End-to-end check of every update: the orchestrator compares the trainer's whole-model digest
    (index.json; broadcast: offer.json, one hash pass on trainer rank 0) with the one each embedded
    worker reports after applying; counts land in metrics.jsonl (weight_updates_verified /
    weight_updates_mismatched). Only when trainer and inference dtypes match."""


limits(WeightsConfig, transport=NONEMPTY, keep_last=ge(2), num_hash_threads=gt(0), max_nonfinite_skips=ge(1))
