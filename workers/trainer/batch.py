"""Training batches from the orchestrator: wait for, load, check and shard ``rollouts/step_N``.

Protocol (orchestrator -> trainer, see workers.common.protocol):
  1. orchestrator writes ``rollouts/.step_N.tmp/{batch.safetensors, meta.json}``, adds
     ``READY``, renames to ``rollouts/step_N`` (publish_dir);
  2. every trainer rank waits for ``step_N/READY`` (deadline trainer.batch_timeout_s, the
     peer named in the error is the orchestrator) and reads the whole files into memory;
  3. after a barrier (all ranks hold step N), rank 0 deletes ``step_M`` for M <= N - 2.
     The trainer never touches ``.step_N.tmp`` dirs: those are the orchestrator's.

Checks here raise :class:`BatchFormatError` naming the tensor, the file and the expected
shape/dtype, so a protocol mismatch fails on the first batch with a readable message
instead of a shape error deep inside the model.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from safetensors.numpy import load_file

from workers.common.protocol import BATCH_POLL_S, READY, RunPaths, wait_for

BATCH_FILE = "batch.safetensors"
META_FILE = "meta.json"
#: Consumed rollout steps left on disk for debugging (step N and N-1); older ones go.
KEEP_ROLLOUTS = 2

#: name -> (allowed numpy dtypes, rank of the array); shapes are checked against [B, T].
_REQUIRED = {
    "input_ids": ((np.int64,), 2),
    "attention_mask": ((np.uint8, np.bool_), 2),
    "loss_mask": ((np.uint8, np.bool_), 2),
    "inference_logprobs": ((np.float32,), 2),
    "advantages": ((np.float32,), (1, 2)),  # per row [B] or per token [B, T]
    "rewards": ((np.float32,), 1),
    "token_versions": ((np.int32,), 2),
}
_OPTIONAL = {
    "routed_experts": ((np.uint8, np.uint16), 4),
    "routed_mask": ((np.uint8, np.bool_), 2),
    "ref_logprobs": ((np.float32,), 2),
    "adapter_ids": ((np.int32,), 1),  # several LoRA adapters: each row's index in trainer.lora.adapters
}


class BatchFormatError(ValueError):
    """A rollout batch does not follow the format of workers.common.protocol."""


@dataclasses.dataclass
class RolloutBatch:
    """One trainer step's rows as torch tensors (masks bool, experts int64)."""

    input_ids: torch.Tensor  # int64 [B, T]
    attention_mask: torch.Tensor  # bool [B, T]
    loss_mask: torch.Tensor  # bool [B, T], already ANDed with attention_mask
    inference_logprobs: torch.Tensor  # float32 [B, T]
    advantages: torch.Tensor  # float32 [B] (per row) or [B, T] (per token)
    rewards: torch.Tensor  # float32 [B]
    token_versions: torch.Tensor  # int32 [B, T]
    routed_experts: Optional[torch.Tensor]  # int64 [B, T, L, k] or None
    routed_mask: Optional[torch.Tensor]  # bool [B, T] or None
    meta: dict
    ref_logprobs: Optional[torch.Tensor] = None  # float32 [B, T]: the reference policy's (KL, distillation)
    token_weight: Optional[torch.Tensor] = None  # float32 [B, T]: loss aggregation (objective.py), set by the step
    adapter_ids: Optional[torch.Tensor] = None  # int64 [B]: each row's adapter (trainer.lora.adapters), or None

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def temperature(self) -> float:
        return float(self.meta["temperature"])

    def rows(self, index: torch.Tensor | slice) -> "RolloutBatch":
        """The same batch restricted to ``index`` rows (tensors are views where possible)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return RolloutBatch(**{n: (v[index] if isinstance(v, torch.Tensor) else v) for n, v in fields.items()})

    def to(self, device: torch.device) -> "RolloutBatch":
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return RolloutBatch(**{n: (v.to(device) if isinstance(v, torch.Tensor) else v) for n, v in fields.items()})


def wait_for_batch(paths: RunPaths, step: int, *, timeout_s: float, publisher=None) -> float:
    """Block until ``rollouts/step_N/READY`` exists; returns the seconds spent waiting. With a
    ``publisher`` the wait is its (collective) ``wait``: a transport may act while the trainer idles."""
    t0 = time.perf_counter()
    ready = paths.rollouts(step) / READY
    if publisher is not None:
        publisher.wait(ready.exists, timeout_s=timeout_s, what=f"training batch {ready}")
    else:
        wait_for(ready.exists, timeout_s=timeout_s, what=f"training batch {ready}", peer="orchestrator", poll_s=BATCH_POLL_S)
    return time.perf_counter() - t0


def load_batch(step_dir: Path, *, step: int, num_layers: int, top_k: int, num_experts: int,
               adapters: tuple = ()) -> RolloutBatch:
    """Read and check one batch directory; the model facts check ``routed_experts``; ``adapters``
    (trainer.lora.adapters, several): every row must name one by its index in ``adapter_ids``."""
    try:
        arrays = load_file(str(step_dir / BATCH_FILE))
        meta = json.loads((step_dir / META_FILE).read_text())
    except (OSError, ValueError) as e:
        raise BatchFormatError(f"cannot read batch {step_dir}: {type(e).__name__}: {e}") from e
    where = step_dir / BATCH_FILE
    _check_meta(meta, step, step_dir / META_FILE)
    for name in _REQUIRED:
        if name not in arrays:
            raise BatchFormatError(f"{where} lacks tensor {name!r} (has {sorted(arrays)}); see workers/common/protocol.py")
    _check_array("input_ids", arrays["input_ids"], _REQUIRED["input_ids"], where)
    b, t = arrays["input_ids"].shape
    for name, arr in arrays.items():
        spec = _REQUIRED.get(name) or _OPTIONAL.get(name)
        if spec is None:
            continue  # extra tensors are allowed (forward compatible), ignored here
        _check_array(name, arr, spec, where)
        want = (b,) if arr.ndim == 1 else (b, t)
        if arr.shape[: len(want)] != want:
            raise BatchFormatError(f"{where}: {name} has shape {arr.shape}, expected leading {want} (input_ids is [B={b}, T={t}])")
    if ("routed_experts" in arrays) != ("routed_mask" in arrays):
        raise BatchFormatError(f"{where}: routed_experts and routed_mask come together (routed_mask flags the rows the engine reported)")
    if "routed_experts" in arrays:
        got = arrays["routed_experts"].shape[2:]
        if got != (num_layers, top_k):
            raise BatchFormatError(f"{where}: routed_experts is [B, T, {got[0]}, {got[1]}], the model has "
                                   f"num_layers({num_layers}) x top_k({top_k})")
        top = int(arrays["routed_experts"].max(initial=0))
        if top >= num_experts:
            raise BatchFormatError(f"{where}: routed_experts holds expert {top} >= num_experts({num_experts})")
        stray = arrays["routed_mask"].astype(bool) & ~arrays["attention_mask"].astype(bool)
        if stray.any():
            r, c = (int(i[0]) for i in np.nonzero(stray))
            raise BatchFormatError(f"{where}: routed_mask marks pad position {c} of row {r}: routing rows must sit "
                                   f"on the tokens they were computed for (Router Replay would replay them elsewhere)")
    if adapters or "adapter_ids" in arrays:
        ids = arrays.get("adapter_ids")
        if not adapters or ids is None or (b and (ids.min() < 0 or ids.max() >= len(adapters))):
            raise BatchFormatError(
                f"{where}: adapter_ids {'absent' if ids is None else sorted(set(ids.tolist()))[:8]} but the run trains "
                f"trainer.lora.adapters={list(adapters)}: each row needs its adapter's index 0..{len(adapters) - 1} "
                f"(a run of one adapter has no adapter_ids)")
    if b and arrays["loss_mask"][:, 0].any():
        raise BatchFormatError(f"{where}: loss_mask[:, 0] must be 0 (token 0 has no preceding logits to score it)")
    return _to_torch(arrays, meta)


def _check_meta(meta: dict, step: int, where: Path) -> None:
    for key in ("temperature", "step"):
        if key not in meta:
            raise BatchFormatError(f"{where} lacks {key!r} (has {sorted(meta)})")
    if int(meta["step"]) != step:
        raise BatchFormatError(f"{where} says step {meta['step']} but sits in the directory of step {step}")
    if not float(meta["temperature"]) > 0:
        raise BatchFormatError(f"{where}: temperature {meta['temperature']} must be > 0 (logprobs of greedy decoding "
                               f"cannot be importance-corrected)")
    if not isinstance(meta.get("orchestrator_metrics", {}), dict):
        raise BatchFormatError(f"{where}: orchestrator_metrics must be a JSON object")


def _check_array(name: str, arr: np.ndarray, spec, where: Path) -> None:
    dtypes, ndim = spec
    if arr.dtype.type not in dtypes or arr.ndim not in (ndim if isinstance(ndim, tuple) else (ndim,)):
        allowed = "|".join(np.dtype(d).name for d in dtypes)
        raise BatchFormatError(f"{where}: {name} is {arr.dtype.name}{list(arr.shape)}, expected {allowed} with {ndim} dims")


def _to_torch(arrays: dict[str, np.ndarray], meta: dict) -> RolloutBatch:
    def t(name: str, dtype: torch.dtype) -> torch.Tensor:
        # astype copies: the safetensors buffers are read-only and uint16 has few torch ops.
        return torch.from_numpy(arrays[name].astype(np.dtype(str(dtype).replace("torch.", "")))).to(dtype)

    attention = t("attention_mask", torch.bool)
    routed = "routed_experts" in arrays
    return RolloutBatch(
        input_ids=t("input_ids", torch.int64),
        attention_mask=attention,
        loss_mask=t("loss_mask", torch.bool) & attention,
        inference_logprobs=t("inference_logprobs", torch.float32),
        advantages=t("advantages", torch.float32),
        rewards=t("rewards", torch.float32),
        token_versions=t("token_versions", torch.int32),
        routed_experts=t("routed_experts", torch.int64) if routed else None,
        routed_mask=t("routed_mask", torch.bool) if routed else None,
        meta=meta,
        ref_logprobs=t("ref_logprobs", torch.float32) if "ref_logprobs" in arrays else None,
        adapter_ids=t("adapter_ids", torch.int64) if "adapter_ids" in arrays else None,
    )


def shard_rows(batch: RolloutBatch, rank: int, world_size: int) -> RolloutBatch:
    """Data-parallel shard: rows ``rank::world_size`` (strided, so a batch sorted by prompt
    spreads every prompt group over the ranks)."""
    if batch.num_rows < world_size:
        raise BatchFormatError(f"batch step {batch.meta.get('step')} has {batch.num_rows} rows, fewer than the "
                               f"trainer data-parallel degree ({world_size}); every rank needs at least one row")
    return batch.rows(torch.arange(rank, batch.num_rows, world_size))


def batch_staleness(batch: RolloutBatch, step: int) -> int:
    """``step - 1 - oldest policy version`` over the loss tokens (0 when no token is tagged):
    1-based step ``step`` trains the weights of version ``step - 1``."""
    versions = batch.token_versions[batch.loss_mask & (batch.token_versions >= 0)]
    return int(step - 1 - versions.min()) if versions.numel() else 0


def prune_rollouts(paths: RunPaths, newest: int, *, keep: int = KEEP_ROLLOUTS,
                   remove: Callable[[Path], None] = lambda p: shutil.rmtree(p, ignore_errors=True)) -> list[int]:
    """Delete consumed ``rollouts/step_M`` with M <= newest - keep; returns the steps removed.

    Only published (``READY``) directories are candidates; temp dirs belong to the writer.
    """
    root = paths.rollouts(0).parent
    removed = []
    if not root.is_dir():
        return removed
    for d in root.iterdir():
        if d.name.startswith("step_") and (d / READY).exists():
            m = int(d.name[5:])
            if m <= newest - keep:
                remove(d)
                removed.append(m)
    return sorted(removed)
