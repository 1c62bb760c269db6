"""Filesystem transport, inference side: verify a published step and read it.

:class:`DiskReader` refuses a missing dir, a missing STABLE, an unreadable index, a
truncated, absent or mis-described shard, a checksum mismatch and a name or shape that does
not fit the model, with :class:`WeightLoadError` naming the file and tensor; nothing is
applied then. Tensors whose hash equals what the worker holds are not read at all (delta
steps cost only their changed bytes on the read side too). :class:`FilesystemReceiver`
puts it behind ``/update_weights_from_disk``. Protocol: the package docstring.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import time
from pathlib import Path
from typing import Mapping, Optional

import torch

from workers.common.protocol import STABLE
from workers.weights.base import Received, WeightLoadError, WeightReceiver, check_fits
from workers.weights.checksums import HASH_NAME
from workers.weights.filesystem.layout import INDEX
from workers.weights.shards import ShardError, Staging, aligned_size, meta_nbytes, nbytes, read_tensors

LoadedStep = Received  # what DiskReader.load returns (the name the engine and tools knew)


class DiskReader:
    """Inference side: verify a published step and read it into a reusable staging buffer."""

    def __init__(self, num_threads: int = 2):
        self.staging = Staging("cpu")
        self._io = cf.ThreadPoolExecutor(num_threads, thread_name_prefix="weights-read")  # one shard per thread

    def load(self, step_dir: Path, expected: Optional[Mapping[str, torch.Tensor]] = None,
             known: Optional[Mapping[str, str]] = None) -> Received:
        """Read step ``step_dir``; ``known`` {name: hash} lists tensors the worker already holds."""
        t0 = time.perf_counter()
        step_dir = Path(step_dir)
        if not step_dir.is_dir():
            raise WeightLoadError(f"weight directory {step_dir} does not exist")
        if not (step_dir / STABLE).exists():
            raise WeightLoadError(f"{step_dir} has no {STABLE} marker: the publisher has not finished it")
        try:
            index = json.loads((step_dir / INDEX).read_text())
            tensors, weight_map = index["tensors"], index["weight_map"]
            assert set(tensors) == set(weight_map), "tensors and weight_map list different names"
        except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
            raise WeightLoadError(f"{step_dir / INDEX} is unreadable: {type(e).__name__}: {e}") from e
        if expected is not None:
            check_fits(tensors, expected, where=str(step_dir))
        known = known or {}
        wanted = [n for n in tensors if known.get(n) != tensors[n][HASH_NAME]]
        paths = {rel: Path(os.path.normpath(step_dir / rel)) for rel in set(weight_map.values())}
        by_file: dict[Path, dict] = {}
        for n in wanted:
            by_file.setdefault(paths[weight_map[n]], {})[n] = (tensors[n]["dtype"], tensors[n]["shape"])
        sizes = {f: aligned_size(meta_nbytes(*v) for v in want.values()) for f, want in by_file.items()}
        staging = self.staging.reserve(sum(sizes.values()))
        jobs, base = {}, 0
        for f, want in by_file.items():
            jobs[f] = self._io.submit(read_tensors, f, want, staging, base)
            base += sizes[f]
        state, got = {}, {}
        try:
            for f, job in jobs.items():
                views, digests = job.result()
                state.update(views)
                got.update({n: (f, d) for n, d in digests.items()})
        except (ShardError, ValueError) as e:
            raise WeightLoadError(str(e)) from e
        for n, (f, digest) in got.items():
            if digest != tensors[n][HASH_NAME]:
                raise WeightLoadError(f"tensor {n} in {f} fails its checksum (corrupt shard): "
                                      f"{digest} != {tensors[n][HASH_NAME]} in {INDEX}")
        return Received(state=state, hashes={n: m[HASH_NAME] for n, m in tensors.items()},
                          bytes=sum(nbytes(t) for t in state.values()), seconds=time.perf_counter() - t0,
                          num_skipped=len(tensors) - len(wanted))

    def close(self) -> None:
        self._io.shutdown(wait=True)


def load_step(step_dir: Path, expected: Optional[Mapping[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
    """Read and verify a whole published step (tools and tests); raises WeightLoadError."""
    reader = DiskReader()
    try:
        return reader.load(Path(step_dir), expected).state
    finally:
        reader.close()


class FilesystemReceiver(WeightReceiver):
    """``/update_weights_from_disk`` of a published ``weights/step_N`` (the only route it uses)."""

    transport = "filesystem"

    def __init__(self, num_threads: int = 2):
        self.reader = DiskReader(num_threads)

    def load(self, path: str, *, expected: Mapping[str, torch.Tensor], known: Mapping[str, str]) -> Received:
        return self.reader.load(Path(path), expected, known)

    def close(self) -> None:
        self.reader.close()


def make_receiver(w, *, device=None) -> FilesystemReceiver:
    """TransportSpec.receiver: reads on the CPU (the engine copies onto its device)."""
    return FilesystemReceiver(w.num_hash_threads)
