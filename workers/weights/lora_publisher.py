"""LoRA mode, trainer side: step 0 is the frozen base, every later version is the adapter alone.

Why one publisher for every transport: after step 0 an update is ``r * (in + out)`` numbers per target
(megabytes where the model is gigabytes), so writing it once to ``run_dir/weights/step_N`` and letting
each server read it is cheaper than forming a broadcast group, and the file is what SGLang's
``/load_lora_adapter`` and ``peft.PeftModel.from_pretrained`` read anyway. Layout and digest:
workers/weights/lora_steps.py; tensors and names: workers/weights/lora_format.py.

Protocol (collective: every trainer rank calls ``publish``):
  ``publish(0, base)``       the base through the filesystem publisher, a full step as without LoRA;
  ``publish_adapter(V >= 1, adapter)`` (the trainer's hook, workers/trainer/lora_publish.py; also
                             ``publish(V, adapter)``) rank 0 writes ``.step_V.tmp/`` (adapter files in the
                             INFERENCE dtype, what the servers hold bit for bit, ``slurmrl_adapter.json`` with
                             the digest of the tensors it wrote, STABLE last: atomic_dir.publish_dir), renames
                             it to ``step_V``, prunes adapter steps beyond ``weights.keep_last`` (never the
                             base); the other ranks' adapter is ignored; one gather at the end, so every
                             rank returns after the step exists.
A NaN/inf adapter is refused like a full step's (weights.skip_nonfinite: skipped instead).
Several adapters (``trainer.lora.adapters``): ``adapter`` is ``{name: Adapter}`` and the step holds
``adapters/<name>/`` per adapter under one side file (lora_steps.py).
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import torch

from workers.common.atomic_dir import publish_dir
from workers.common.dtypes import held_dtype, torch_dtype
from workers.common.protocol import STABLE, step_name
from workers.weights.base import Peers, SyncStats, WeightPublisher, peers_for, refuse_nonfinite
from workers.weights.checksums import state_digest, tensor_hash
from workers.weights.lora_format import Adapter, peft_state, write_adapter
from workers.weights.lora_steps import ADAPTERS_DIR, BASE_STEP, FORMAT, SIDECAR, combined_digest


def adapter_files_digest(state: dict[str, torch.Tensor]) -> str:
    """The confirmation digest of PEFT-named tensors (lora_steps.py): the trainer's over what it writes, an
    engine's over its buffers read back (workers/inference/embedded/lora.EngineLora.digest)."""
    return state_digest({k: tensor_hash(v) for k, v in state.items()})


class AdapterPublisher(WeightPublisher):
    """Step 0 through ``base`` (a full-step publisher), adapters as PEFT directories (module docstring)."""

    def __init__(self, base: WeightPublisher, root: Path, *, peers: Peers, keep_last: int,
                 skip_nonfinite: bool = False, dtype: torch.dtype = torch.float32):
        self.base, self.root, self.peers, self.keep_last = base, Path(root), peers, keep_last
        self.skip_nonfinite, self.dtype = skip_nonfinite, dtype

    def publish(self, version: int, weights: Any) -> SyncStats:
        """Version 0: the base (full step); later versions: ``weights`` is the Adapter (rank 0's is written)."""
        if version == BASE_STEP:
            if isinstance(weights, Adapter):
                raise ValueError("lora: version 0 is the frozen base; publish the base model there, adapters from 1 on")
            return self.base.publish(version, weights)
        return self.publish_adapter(version, weights)

    def publish_adapter(self, version: int, adapter: Optional[Adapter | dict[str, Adapter]]) -> SyncStats:
        """COLLECTIVE: rank 0 writes ``adapter`` (several: ``{name: Adapter}``) as step ``version``
        (workers/trainer/lora_publish.py calls this hook); every rank returns once the step exists or
        was refused."""
        t0 = time.perf_counter()
        nbytes, skipped = 0, False
        if self.peers.rank == 0:
            several = adapter if isinstance(adapter, dict) else None
            if not (isinstance(adapter, Adapter) or (several and all(isinstance(a, Adapter) for a in several.values()))):
                raise TypeError(f"lora: version {version} must be an Adapter (or {{name: Adapter}}) on rank 0 "
                                f"(got {type(adapter).__name__})")
            states = {n: peft_state(a, self.dtype) for n, a in (several or {"": adapter}).items()}
            bad = [f"{n}/{k}".lstrip("/") for n, st in states.items() for k, t in st.items()
                   if not bool(torch.isfinite(t).all())]
            skipped = refuse_nonfinite(version, bad, skip=self.skip_nonfinite)
            if not skipped:
                nbytes = self._write(version, adapter, states)
        self.peers.all_gather_object(None)
        return SyncStats(bytes=nbytes, seconds=time.perf_counter() - t0, skipped=skipped)

    def _write(self, version: int, adapter: Adapter | dict[str, Adapter], states: dict[str, dict]) -> int:
        nbytes = sum(t.numel() * t.element_size() for st in states.values() for t in st.values())
        digests = {n: adapter_files_digest(st) for n, st in states.items()}
        first = adapter if isinstance(adapter, Adapter) else next(iter(adapter.values()))
        side = {"format": FORMAT, "step": version, "base_step": BASE_STEP, "bytes": nbytes, "rank": first.rank,
                "alpha": first.alpha}
        if isinstance(adapter, dict):  # several adapters: the step's digest is the combination of theirs
            side.update(digest=combined_digest(digests), adapters=digests)
        else:
            side["digest"] = digests[""]

        def write(tmp: Path) -> None:
            if isinstance(adapter, dict):
                for name, one in adapter.items():
                    write_adapter(tmp / ADAPTERS_DIR / name, one, step=version, dtype=self.dtype)
            else:
                write_adapter(tmp, adapter, step=version, dtype=self.dtype)
            (tmp / SIDECAR).write_text(json.dumps(side, indent=1) + "\n")

        publish_dir(self.root / step_name(version), write, STABLE)  # STABLE last, then one rename
        prune_adapters(self.root, keep_last=self.keep_last, newest=version)
        return nbytes

    def close(self) -> None:
        self.base.close()


def prune_adapters(root: Path, *, keep_last: int, newest: int) -> list[str]:
    """Delete adapter steps older than the newest ``keep_last``; the base step and full steps stay."""
    gone = []
    for d in root.iterdir():
        if d.name.startswith("step_") and d.name[5:].isdigit() and BASE_STEP < int(d.name[5:]) <= newest - keep_last \
                and (d / SIDECAR).is_file():
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d.name)
    return sorted(gone)


def make_lora_publisher(cfg, paths, topology=None, *, rank: int, world_size: int,
                        device: Optional[torch.device] = None) -> AdapterPublisher:
    """The trainer's publisher in LoRA mode, whatever ``weights.transport`` (module docstring)."""
    from workers.weights.filesystem.hf_layout import hf_files
    from workers.weights.filesystem.publisher import FilesystemPublisher

    peers = peers_for(rank, world_size)
    w = cfg.weights
    base = FilesystemPublisher(paths.root / "weights", peers=peers, keep_last=w.keep_last,
                               skip_nonfinite=w.skip_nonfinite, hf=hf_files(cfg.model))
    # in the inference dtype: what the servers hold, bit for bit, so their digest can equal the trainer's
    return AdapterPublisher(base, paths.root / "weights", peers=peers, keep_last=w.keep_last,
                            skip_nonfinite=w.skip_nonfinite, dtype=torch_dtype(held_dtype(cfg.inference.dtype)))
