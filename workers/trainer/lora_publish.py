"""LoRA runs on the trainer: the step-0 model with adapters, and publishing adapters as weight updates.

Published versions (issue 44): version 0 is the BASE (the full model, as in full fine-tuning: B is
zero at step 0, so the step-0 policy is the base), every later version is the PEFT adapter of
workers/weights/lora_format.py, written by :func:`write_step_adapter` -- the one function a
transport calls to lay out an adapter step directory. A transport that handles adapters itself
defines ``publish_adapter(version, adapter) -> SyncStats`` (the engine side of issue 44); for one
that does not, rank 0 writes ``weights/step_N/`` here with the filesystem protocol's atomic
``.step_N.tmp`` + STABLE + rename (workers/common/atomic_dir.py ``publish_dir``).

The adapter's ``base_model_name_or_path`` is ``model.path`` (the user's checkpoint) when the run has
one, else the run's ``weights/step_000000`` (the published base).
"""
from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Iterable

import torch

from workers.common.config import ConfigError, RunConfig
from workers.common.atomic_dir import publish_dir
from workers.common.config.lora import several_adapters_error
from workers.common.protocol import STABLE, RunPaths
from workers.common.registry import MODELS
from workers.models.lora.inject import apply_lora, gather_adapter, init_tensors, split_adapters
from workers.weights.base import SyncStats, WeightPublisher
from workers.weights.lora_format import Adapter, peft_state, write_adapter


def check_layout(cfg: RunConfig) -> None:
    """ConfigError for what LoRA does not run with (the plan refuses it first: launcher/lora_plan.py)."""
    par = cfg.trainer.parallel
    if cfg.trainer.lora.enabled and (par.tp > 1 or par.ep > 1):
        raise ConfigError(f"trainer.lora.rank={cfg.trainer.lora.rank} with trainer.parallel.tp={par.tp} / "
                          f"trainer.parallel.ep={par.ep}: LoRA runs on the FSDP plan only (tp = ep = 1) for now")
    why = several_adapters_error(cfg)
    if why:
        raise ConfigError(why)


def add_adapters(cfg: RunConfig, full, tensors: Iterable) -> Iterable:
    """Turn ``full`` (built, maybe on meta) into the LoRA model of trainer.lora and return ``tensors``
    (its base's stream for ``materialize``, names read already) followed by the adapters' initial values."""
    apply_lora(full, cfg.trainer.lora, family=cfg.model.family)
    return itertools.chain(tensors, init_tensors(full, cfg.model.init_seed))


@torch.no_grad()
def init_in_place(cfg: RunConfig, full) -> None:
    """A fully built (not meta) model: make it the LoRA model and fill the adapters' initial values."""
    stream = add_adapters(cfg, full, ())  # adds the adapter parameters: read the names after it
    state = dict(full.named_parameters())
    for name, t in stream:
        state[name].copy_(t)


def base_model_of(cfg: RunConfig, paths: RunPaths) -> str:
    return str(cfg.model.path) if getattr(cfg.model, "path", "") else str(paths.weights(0))


def write_step_adapter(step_dir: Path, adapter: Adapter, *, version: int, dtype: torch.dtype) -> Path:
    """THE adapter step directory (workers/weights/lora_format.py); what every transport writes or serves."""
    return write_adapter(step_dir, adapter, step=version, dtype=dtype)


def adapter_bytes(adapter: Adapter, dtype: torch.dtype) -> int:
    return sum(t.numel() * t.element_size() for t in peft_state(adapter, dtype).values())


def publish_adapter(publisher: WeightPublisher, version: int, model, cfg: RunConfig, paths: RunPaths, *,
                    rank: int, dtype: torch.dtype) -> dict:
    """Publish version ``version``'s adapter (COLLECTIVE: every rank gathers it); the weight_sync_* metrics.
    Several adapters (trainer.lora.adapters): ``{name: Adapter}``, one PEFT directory each."""
    t0 = time.perf_counter()
    adapter = gather_adapter(model, cfg.trainer.lora, to_hf=MODELS.get(cfg.model.family).to_hf,
                             base_model=base_model_of(cfg, paths))
    if len(cfg.trainer.lora.adapters) > 1:
        adapter = split_adapters(adapter, cfg.trainer.lora.adapters)
    if hasattr(publisher, "publish_adapter"):  # the transport handles adapters itself
        return publisher.publish_adapter(version, adapter).metrics()
    if isinstance(adapter, dict):
        raise TypeError(f"lora: {type(publisher).__name__} has no publish_adapter, which several adapters need "
                        f"(workers/weights/lora_publisher.py AdapterPublisher)")
    if rank == 0:
        publish_dir(paths.weights(version), lambda tmp: write_step_adapter(tmp, adapter, version=version, dtype=dtype),
                    STABLE)
    return SyncStats(bytes=adapter_bytes(adapter, dtype), seconds=time.perf_counter() - t0).metrics()
