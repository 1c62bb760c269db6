"""The weights settings both step-publishing transports share: sparse patches, delta files, async publishing.

It is the filesystem transport's schema (``weights/filesystem.yaml``) and the base of every other
transport's: Hydra merges the chosen transport's schema onto RunConfig's default ``weights`` (the
filesystem one), which needs the chosen schema to be a subclass of the default's. And every transport
writes ``run_dir/weights/step_N`` (broadcast: step 0, fallbacks and SGLang's anchors) and may send sparse
patches (this package's format). Here and not in the filesystem package so that the broadcast schema
extends it without importing that transport (tests/unit/repo/test_transport_imports.py). Torch-free: the
launcher reads it.
"""
from __future__ import annotations

import dataclasses

from workers.common.config.ranges import between, gt, limits, one_of
from workers.common.config.weights import WeightsConfig
from workers.weights.delta import DELTA_FRACTION_DEFAULT


@dataclasses.dataclass(kw_only=True)
class DeltaWeightsConfig(WeightsConfig):
    """``weights/filesystem.yaml``, and the fields every transport adds to: steps under run_dir/weights,
    sparse patches, tensor-level delta files."""

    delta: bool = False
    """Sparse patches: each version after an anchor carries only the published elements that changed
    (exact, bit for bit; typically 1-3 % with bf16 published over fp32 master weights at RL learning
    rates), and publishing runs beside training. A patch step is not an HF directory by itself
    (``python -m workers.weights.filesystem.resolve`` makes one). False: every step is the full model
    (the CPU default: fp32 published over fp32 master changes nearly every element each step)."""
    delta_full_every: int = 10
    """Every this many versions a full step (an anchor) is published: the chain a fresh or respawned
    worker replays (anchor + patches) and what retention must keep are bounded by it."""
    delta_snapshot: str = "device"
    """Where the trainer keeps the last published values it diffs against (published dtype, this
    rank's shards: 2 bytes per bf16 element): ``device`` (fastest) or ``host`` (pinned host memory,
    when GPU memory is tight)."""
    publish_async: bool = True
    """Patches (and one-rank anchors) are written by a background thread while the next step trains;
    the trainer blocks only for the diff. False: publishing finishes before training goes on."""
    delta_fraction_assumed: float = DELTA_FRACTION_DEFAULT
    """With ``delta``: the changed fraction of published elements per update that the plan's cost line
    (and, over ``broadcast``, the simulator) assume (workers/weights/sglang/patch_cost.py). Default
    0.02, the middle of public measurements at RL learning rates (1-3 %; verl measured 0.8-1.1 % on MoE
    models); ``benchmarks.weight_delta`` measures ours. It sizes nothing at run time: patches are as big
    as what changed."""
    delta_files: bool = False
    """Tensor-level delta (without ``delta``): write only tensors whose checksum changed since the
    previous step; index.json points unchanged ones at the earlier file, so such steps load in
    transformers directly (frozen layers then cost nothing per step)."""


limits(DeltaWeightsConfig, delta_full_every=gt(0), delta_snapshot=one_of("device", "host"),
       delta_fraction_assumed=between(0.0, 1.0))
