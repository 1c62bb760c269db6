"""The embedded engine's weight updates: one load path (the transport's receiver), staged, then swapped.

Why staged: an update used to read, copy and patch with the model lock held or the engine paused, so
decoding stopped for the whole load (0.25 s per step for a 135M model on an H100, most of it host work
and per-tensor copies, not bandwidth). Now an update has two parts:

1. **stage** (no model lock: decoding goes on, on the weights it has): the receiver reads and verifies
   the step (checksums, NaN/inf, shapes); dense tensors are cast and copied onto the engine's device
   into side buffers (on CUDA when they fit in half the free memory, else they stay on the host and
   are copied at the swap); sparse patches are composed and verified against the live weights,
   which are only read (workers/weights/delta/apply.stage_chain). A refusal here leaves the engine
   exactly as it was.
2. **swap** (model lock, between two decode steps / blocks): one ``torch._foreach_copy_`` of the
   staged dense tensors and one ``index_copy_`` per patched storage, into the same parameters, so
   captured CUDA graphs stay valid; then the version the engine tags tokens with changes. Tokens
   sampled before the swap carry the old version, after it the new one: a sequence spanning the
   swap carries both (per-token versions), as with a pause.

Weights change only through these methods and each update holds ``_update_lock`` from stage to
swap, so what was verified while staging is what the swap overwrites. The receiver is the one the
weight routes use (workers/inference/embedded/weight_routes.py): the worker's startup load and every
route go through it, so there is one reader per worker (issue 46).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Optional

import torch

from workers.inference.embedded import fp8
from workers.weights.base import Received, WeightLoadError, WeightReceiver
from workers.weights.checksums import state_digest, state_hashes
from workers.weights.delta.apply import StagedPatches, stage_chain
from workers.weights.lora_steps import adapter_dirs, combined_digest, is_adapter_step

log = logging.getLogger("slurmrl.inference")


@dataclasses.dataclass
class StagedWeights:
    """A verified update ready to swap in (``Received`` copied next to the model, nothing live changed)."""

    dst: list[torch.Tensor]
    src: list[torch.Tensor]
    patches: Optional[StagedPatches]
    received: Received
    on_device: bool


def _default_receiver() -> WeightReceiver:
    from workers.weights.filesystem.receiver import FilesystemReceiver

    return FilesystemReceiver()


class EngineWeights:
    """The weight half of :class:`~workers.inference.embedded.engine.InferenceEngine` (a mixin: it uses the
    engine's ``model``, ``lora``, ``_model_lock``, ``abort`` and ``num_running``/``num_pending``)."""

    def _init_weights(self, weight_version: int) -> None:
        self.weight_version = weight_version
        self.model_path: Optional[str] = None
        self.weight_hashes: dict[str, str] = {}  # digests of what we hold (full steps skip unchanged tensors)
        self.weight_sums: dict[str, int] = {}  # sum64 per tensor of what we hold (patch steps find their base by it)
        self.known_digest: Optional[str] = None  # the whole-model digest the last update's transport vouched for
        self.receiver: Optional[WeightReceiver] = None  # the transport's (use_receiver); filesystem until then
        self.receiver_config: Any = None
        # the last disk update's parts, seconds (read, stage, lock_wait, swap, total): the route answers them
        self.update_timing: dict[str, float] = {}
        self._lock_wait_s = 0.0

    # ---- the receiver ------------------------------------------------------------------
    def use_receiver(self, receiver: WeightReceiver, config: Any = None) -> None:
        """Load every later update through ``receiver`` (``config``: the weights config it was built from)."""
        if self.receiver is not None and self.receiver is not receiver:
            self.receiver.close()
        self.receiver, self.receiver_config = receiver, config

    def receiver_for(self, weights: Any, make) -> WeightReceiver:
        """The receiver of ``weights`` (a WeightsConfig): the one held when it was built from an equal
        config, else ``make()``'s, which replaces it."""
        if self.receiver is None or self.receiver_config != weights:
            self.use_receiver(make(), weights)
        return self.receiver

    def _receiver(self) -> WeightReceiver:
        if self.receiver is None:
            self.use_receiver(_default_receiver())
        return self.receiver

    # ---- updates -----------------------------------------------------------------------
    def update_weights_from_disk(self, model_path: str, weight_version: int, *, abort_all: bool = False) -> int:
        """Verify and load a published weights/step_N dir (or, LoRA mode, an adapter step) through the
        receiver; returns the requests in flight. A missing, partial, corrupt or mis-shaped step raises
        WeightLoadError and leaves the old weights in place. Decoding goes on until the swap."""
        if abort_all:
            self.abort(None, wait=True)
        if self.lora is not None and is_adapter_step(model_path):
            return self.load_adapter(model_path, weight_version)[0]
        t0 = time.perf_counter()
        with self._update_lock:  # a second update must not stage against a half-applied first
            got = self._receiver().load(str(model_path), expected=self.model.state_dict(), known=self.weight_hashes,
                                        sums=self.weight_sums)
            read_s = time.perf_counter() - t0
            n = self._stage_and_swap(got, weight_version, source=str(model_path))
        self.update_timing = {"read_s": read_s, **self.update_timing, "total_s": time.perf_counter() - t0}
        log.info("loaded weights v%d from %s: %.1f MB in %.3fs, %d tensors unchanged, %d requests in flight (%s)",
                 weight_version, model_path, got.bytes / 1e6, got.seconds, got.num_skipped, n,
                 ", ".join(f"{k} {v:.3f}" for k, v in self.update_timing.items()))
        return n

    def apply_received(self, got: Received, weight_version: int, *, source: str) -> int:
        """Stage and swap in what a receiver returned (the broadcast route); returns requests in flight."""
        with self._update_lock:
            return self._stage_and_swap(got, weight_version, source=source)

    def apply_weights(self, state, weight_version: int, *, source: str, hashes=None, patches=(), sums=None) -> int:
        """Tools and tests: ``state`` (any subset of the parameters, cast to the model's dtype) and sparse
        ``patches`` (after ``sums``), staged and swapped like a received update."""
        got = Received(state=dict(state), hashes=hashes, bytes=0, seconds=0.0, patches=list(patches), sums=sums)
        return self.apply_received(got, weight_version, source=source)

    def _stage_and_swap(self, got: Received, weight_version: int, *, source: str) -> int:
        t0 = time.perf_counter()
        staged = self.stage(got)
        t1 = time.perf_counter()
        n = self.swap(staged, weight_version, source=source)
        self.update_timing = {"stage_s": t1 - t0, "lock_wait_s": self._lock_wait_s,
                              "swap_s": time.perf_counter() - t1 - self._lock_wait_s}
        return n

    @torch.no_grad()
    def stage(self, got: Received) -> StagedWeights:
        """Part 1 (module docstring): no model lock; raises WeightLoadError with nothing changed. The
        caller holds ``_update_lock`` until :meth:`swap`."""
        params = self.model.state_dict()
        patches = None
        if got.patches:
            try:
                patches = stage_chain(params, got.patches, got.sums or {})
            except WeightLoadError:  # what we hold is not what our sums say: the next update goes
                self.weight_sums = {}  # through the anchor (patch_reader.py) instead
                raise
        dst = [params[n] for n in got.state]
        nbytes = sum(d.numel() * d.element_size() for d in dst)
        device = self.device
        on_device = device.type != "cuda" or nbytes <= torch.cuda.mem_get_info(device)[0] // 2
        src = [t.to(device=d.device, dtype=d.dtype) if on_device else t for d, t in zip(dst, got.state.values())]
        return StagedWeights(dst=dst, src=src, patches=patches, received=got, on_device=on_device)

    @torch.no_grad()
    def swap(self, staged: StagedWeights, weight_version: int, *, source: str) -> int:
        """Part 2: between two steps, write the staged update and serve ``weight_version``; returns
        requests in flight."""
        got = staged.received
        t0 = time.perf_counter()
        with self._model_lock:
            self._lock_wait_s = time.perf_counter() - t0  # until the decode block in flight ended
            sums = staged.patches.commit() if staged.patches is not None else got.sums
            if staged.on_device and staged.dst:
                torch._foreach_copy_(staged.dst, staged.src)
            else:
                for d, s in zip(staged.dst, staged.src):
                    d.copy_(s)
            self.weight_version = int(weight_version)
            self.model_path = source
            self.weight_hashes = dict(got.hashes or {})
            self.weight_sums = dict(sums or {})
            self.known_digest = got.digest
            self._weights_changed_locked()
            return self.num_running + self.num_pending

    def weights_digest(self) -> str:
        """checksums.state_digest of what the engine holds (the routes' ``weights_digest``): the transport's
        word for patch steps (every touched tensor was verified while applied, sum64), else every tensor hashed."""
        if self.known_digest is not None:
            return self.known_digest
        return state_digest(state_hashes(self.model.state_dict()))  # no lock: only updates change weights

    def load_adapter(self, path: str, weight_version: int, *, slot: int = 0) -> tuple[int, str]:
        """LoRA mode: read a published adapter step (outside the model lock) and copy it into adapter
        ``slot`` between steps, verified (workers/inference/embedded/lora.py); the engine then serves
        ``weight_version``. A several-adapter step (``adapters/<name>/``, workers/weights/lora_steps.py)
        fills every slot by name, all files read before any is copied. Returns (requests in flight, the
        digest of the adapter's tensors; several: the combination of every slot's)."""
        from workers.inference.embedded.lora import read_step

        if self.lora is None:
            raise WeightLoadError(f"{path} is a LoRA adapter but this engine serves no adapters (trainer.lora.rank=0)")
        with self._update_lock:
            several = adapter_dirs(path)
            if several and sorted(several) != sorted(self.lora.names):
                raise WeightLoadError(f"{path} holds adapters {sorted(several)}; this engine serves "
                                      f"{sorted(self.lora.names)} (trainer.lora.adapters)")
            adapters = ({self.lora.index(n): read_step(d) for n, d in several.items()} if several
                        else {slot: read_step(path)})
            with self._model_lock:
                for s, adapter in adapters.items():
                    self.lora.load(adapter, slot=s, version=int(weight_version))
                # of the buffers the forward reads, not of the files
                digests = {self.lora.names[s]: self.lora.digest(s) for s in adapters}
                digest = combined_digest(digests) if several else digests[self.lora.names[slot]]
                self.weight_version = int(weight_version)
                self.model_path = str(path)
                self._weights_changed_locked()
                n = self.num_running + self.num_pending
        for s, adapter in adapters.items():
            log.info("loaded adapter v%d (rank %d, %d targets) from %s into slot %d (%s), digest %s, %d requests in "
                     "flight", weight_version, adapter.rank, len(adapter.tensors), path, s, self.lora.names[s],
                     digests[self.lora.names[s]], n)
        if several:
            log.info("loaded adapters v%d %s, step digest %s", weight_version, sorted(several), digest)
        return n, digest

    def patch_weights(self, patch, weight_version: int, *, source: str):
        """Run ``patch(params)`` (an in-place, verified patch: workers/weights/broadcast/delta_wire.py)
        in between steps; on success the engine serves ``weight_version``. The per-tensor hashes
        are dropped (they no longer describe the weights). Returns what ``patch`` returns."""
        with self._model_lock, torch.no_grad():
            out = patch(self.model.state_dict())
            self.weight_version = int(weight_version)
            self.model_path = source
            self.weight_hashes = {}
            self._weights_changed_locked()
            return out

    def set_weight_version(self, version: int) -> None:
        with self._model_lock:
            self.weight_version = int(version)
            self._weights_changed_locked()

    def _weights_changed_locked(self) -> None:
        """Hook for engines that keep copies of the weights or the version (the static engine's
        CUDA graphs: workers/inference/embedded/static_engine.py). Here: an fp8 model
        (inference.dtype=float8) re-quantizes the projections whose bf16 weights changed."""
        fp8.refresh(self.model)
