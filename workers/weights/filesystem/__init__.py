"""Filesystem weight transport (``weights.transport=filesystem``): trainer ranks publish
``run_dir/weights/step_N/``, the orchestrator tells workers to load it.

One step on disk (HF layout; ``model.safetensors`` when one rank writes)::

    step_000007/model-00001-of-00002.safetensors   rank 0's share of the tensors
    step_000007/model-00002-of-00002.safetensors   rank 1's share
    step_000007/index.json   {"format", "step", "metadata": {"total_size"},
                              "weight_map": {name: file, relative to this dir},
                              "tensors": {name: {"shape", "dtype", "xxh3"}}}
    step_000007/STABLE       written last

For a family with a config.json mapping (``to_hf_config``), rank 0 also writes, before STABLE,
``config.json``, ``model.safetensors.index.json`` and the source's tokenizer files: the step is
a Hugging Face directory (hf_layout.py; delta steps and ``resolve.py`` there too).

Protocol for version V (T: trainer ranks, O: orchestrator, W: inference workers):
  T  every rank calls publish(V) after its optimizer step (publisher.py; waits are the
     trainer group's collectives, bounded by its process-group timeout):
       1. rank 0 empties ``.step_V.tmp/``; gather #1 (everyone knows the dir exists);
       2. rank r writes its share (base.assign_shares: by bytes, the same split every step)
          to ``<shard>.partial``, hashing each chunk as it is written (shards.py), fsyncs,
          renames to ``<shard>``; gather #2 brings every rank's {name: shape, dtype, hash, file};
       3. rank 0 writes index.json, then STABLE, fsyncs, renames ``.step_V.tmp`` -> ``step_V``
          (readers never see a partial step), then prunes old steps in a background thread
          (the next publish, and close(), wait for it).
     Nobody on the trainer side waits for inference.
  O  each loop turn, if the newest STABLE step V is newer than what workers serve
     (coordinator.py): ``/pause_generation`` in_place on every live worker ->
     ``/update_weights_from_disk`` {model_path: weights/step_V, weight_version: V} on all
     at once -> ``/continue_generation`` (also after a failure) -> with ``weights.verify``,
     each worker's reported ``weights_digest`` against index.json's. Every call has the
     client's deadline (orchestrator.request_timeout_s). A refusal keeps the old version;
     the next turn retries the newest step.
  W  (receiver.py, DiskReader) refuses a missing dir, a missing STABLE, an unreadable
     index, a truncated, absent or mis-described shard, a checksum mismatch and a name or
     shape that does not fit the model, naming the file and tensor; nothing is applied
     then. Tensors whose hash equals what the worker holds are not read at all.
Workers boot the same way: wait for any STABLE (inference.startup_timeout_s), load the newest.

Sparse patches (``weights.delta``; the GPU presets turn them on): after an anchor (a full step, every
``delta_full_every`` versions and after a restart), a step holds only the elements that changed, as
patches with their base version; publishing runs beside training (patch_publisher.py has the layout
and protocol, workers/weights/delta the format). Workers holding the base apply the patch in place;
others load the anchor and every patch after it. Any step resolves to a full HF directory (resolve.py).
SGLang servers cannot load a patch step from disk: with them the orchestrator posts a descriptor naming
the step and each TP rank's custom weight loader pulls only the entries of the tensors it holds
(workers/weights/sglang/: pull_coordinator.py, patch_pull.py); anchors and refusals still go through /update_weights_from_disk.

Tensor-level delta files (``weights.delta_files``): a rank writes only tensors whose hash changed since its
previous publish; index.json then points unchanged tensors at the file that holds them,
in an earlier step (``../step_000005/model-00001-of-00002.safetensors``). Every
``delta_full_every`` steps (and after a restart) a full step cuts the chain. Retention keeps
the newest ``keep_last`` steps plus every step one of them references, so a kept index
never points at a deleted file; once a full step is among the kept ones, old steps go.

This module is torch-free (the launcher reads it): the check and the spec; the schema is
workers/weights/delta/config.py's DeltaWeightsConfig, which every other transport's extends.
"""
from __future__ import annotations

from workers.common.dtypes import held_dtype
from workers.common.registry import TRANSPORTS
from workers.weights.delta.config import DeltaWeightsConfig
from workers.weights.spec import TransportSpec, lazy


def check(cfg) -> None:
    """Plan-time: the delta chain must be cut at some point; one delta mode at a time; patches need the
    inference dtype to hold the published values exactly."""
    w = cfg.weights
    if w.delta_full_every < 1:
        raise ValueError(f"weights.delta_full_every must be >= 1, got {w.delta_full_every}")
    if w.delta and w.delta_files:
        raise ValueError("weights.delta=true and weights.delta_files=true: pick one (delta: sparse patches; "
                         "delta_files: whole changed tensors)")
    if w.delta and held_dtype(cfg.inference.dtype) not in (cfg.trainer.dtype, "float32"):
        raise ValueError(f"weights.delta=true: inference.dtype={cfg.inference.dtype} cannot hold the trainer's "
                         f"published {cfg.trainer.dtype} values exactly, so patches could not be verified; set "
                         f"inference.dtype={cfg.trainer.dtype} or weights.delta=false")


SPEC = TRANSPORTS.register(TransportSpec(
    name="filesystem", config=DeltaWeightsConfig, check=check,
    summary="trainer ranks write run_dir/weights/step_N; workers load it on /update_weights_from_disk",
    publisher=lazy("workers.weights.filesystem.patch_publisher:make_publisher"),
    coordinator=lazy("workers.weights.filesystem.coordinator:make_coordinator"),
    receiver=lazy("workers.weights.filesystem.receiver:make_receiver"),
    update_line=lazy("workers.weights.sglang.pull_cost:update_line")))
