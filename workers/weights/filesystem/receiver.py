"""Filesystem transport, inference side: verify a published step and read it.

:class:`DiskReader` refuses a missing dir, a missing STABLE, an unreadable index, a
truncated, absent or mis-described shard, a shard that is not a regular file inside the
weights root (FIFO, device, symlink), a checksum mismatch, a tensor holding NaN/inf and a
name or shape that does not fit the model, with :class:`WeightLoadError` naming the file and tensor; nothing is
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

from workers.common.protocol import STABLE, is_marked
from workers.weights.base import Received, WeightLoadError, WeightReceiver, check_fits
from workers.weights.checksums import HASH_NAME
from workers.weights.delta.index import index_sums, is_patch_index
from workers.weights.filesystem.layout import INDEX
from workers.weights.filesystem.patch_reader import load_patch_step
from workers.weights.shards import (BY_NAME, ShardError, Staging, aligned_size, meta_nbytes, nbytes, open_regular,
                                   read_tensors)

MAX_INDEX_BYTES = 64 << 20
"""An index.json larger than this is refused (a real one is ~100 bytes per tensor)."""
LoadedStep = Received  # what DiskReader.load returns (the name the engine and tools knew)


def _index_problem(index) -> str:
    """What is wrong with a parsed index.json ('' if nothing): every field the reader uses."""
    if not isinstance(index, dict):
        return "not a JSON object"
    tensors, weight_map = index.get("tensors"), index.get("weight_map")
    if not isinstance(tensors, dict) or not isinstance(weight_map, dict):
        return "tensors and weight_map must be objects"
    if set(tensors) != set(weight_map):
        return "tensors and weight_map list different names"
    for n, m in tensors.items():
        if not (isinstance(m, dict) and isinstance(m.get(HASH_NAME), str) and m.get("dtype") in BY_NAME
                and isinstance(m.get("shape"), list) and all(type(d) is int and d >= 0 for d in m["shape"])):
            return f"tensors[{n!r}] must be {{shape: [int >= 0], dtype: one of {sorted(BY_NAME)}, {HASH_NAME}: str}}"
        f = weight_map[n]
        if not (isinstance(f, str) and f and "\0" not in f and not os.path.isabs(f)):
            return f"weight_map[{n!r}] must be a relative file name, got {f!r}"
    return ""


def _inside(path: Path, root: Path) -> bool:
    return os.path.commonpath([os.path.abspath(path), os.path.abspath(root)]) == os.path.abspath(root)


class DiskReader:
    """Inference side: verify a published step and read it into a reusable staging buffer."""

    def __init__(self, num_threads: int = 2):
        self.staging = Staging("cpu")
        self._io = cf.ThreadPoolExecutor(num_threads, thread_name_prefix="weights-read")  # one shard per thread

    def load(self, step_dir: Path, expected: Optional[Mapping[str, torch.Tensor]] = None,
             known: Optional[Mapping[str, str]] = None, sums: Optional[Mapping[str, int]] = None) -> Received:
        """Read step ``step_dir``; ``known`` {name: hash} lists tensors the worker already holds.

        Shards must be regular files inside the weights root (``step_dir``'s parent: delta
        steps point at earlier steps' files); a tensor holding NaN/inf is refused like a
        checksum mismatch, found in the same pass as the checksum."""
        t0 = time.perf_counter()
        step_dir = Path(step_dir)
        try:
            if not step_dir.is_dir():
                raise WeightLoadError(f"weight directory {step_dir} does not exist")
        except (ValueError, OSError) as e:  # a NUL byte, a name too long
            raise WeightLoadError(f"weight directory {str(step_dir)!r} is not a valid path ({e})") from None
        if not is_marked(step_dir):
            raise WeightLoadError(f"{step_dir} has no {STABLE} marker (a regular file): the publisher has not "
                                  f"finished it")
        try:
            with open_regular(step_dir / INDEX, INDEX) as f:
                if os.fstat(f.fileno()).st_size > MAX_INDEX_BYTES:
                    raise ValueError(f"over {MAX_INDEX_BYTES} bytes")
                index = json.loads(f.readall())
        except ShardError as e:
            raise WeightLoadError(str(e)) from None
        except (OSError, ValueError, RecursionError) as e:
            raise WeightLoadError(f"{step_dir / INDEX} is unreadable: {type(e).__name__}: {str(e)[:200]}") from None
        if is_patch_index(index):  # weights.delta: patches on top of what the worker holds, or of the anchor
            got = load_patch_step(step_dir, index, expected=expected, sums=sums,
                                  load_full=lambda d: self.load(d, expected, None))
            got.seconds = time.perf_counter() - t0
            return got
        problem = _index_problem(index)
        if problem:
            raise WeightLoadError(f"{step_dir / INDEX} is malformed: {problem}"[:500])
        tensors, weight_map = index["tensors"], index["weight_map"]
        if expected is not None:
            check_fits(tensors, expected, where=str(step_dir))
        known = known or {}
        wanted = [n for n in tensors if known.get(n) != tensors[n][HASH_NAME]]
        paths = {rel: Path(os.path.normpath(step_dir / rel)) for rel in set(weight_map.values())}
        outside = sorted(rel for rel, p in paths.items() if not _inside(p, step_dir.parent))
        if outside:
            raise WeightLoadError(f"{step_dir / INDEX}: weight_map points outside the weights root {step_dir.parent}: "
                                  f"{outside[0]!r}")
        by_file: dict[Path, dict] = {}
        for n in wanted:
            by_file.setdefault(paths[weight_map[n]], {})[n] = (tensors[n]["dtype"], tensors[n]["shape"])
        sizes = {f: aligned_size(meta_nbytes(*v) for v in want.values()) for f, want in by_file.items()}
        staging = self.staging.reserve(sum(sizes.values()))
        jobs, base = {}, 0
        for f, want in by_file.items():
            jobs[f] = self._io.submit(read_tensors, f, want, staging, base)
            base += sizes[f]
        state, got, bad = {}, {}, []
        try:
            for f, job in jobs.items():
                views, digests, nonfinite = job.result()
                state.update(views)
                got.update({n: (f, d) for n, d in digests.items()})
                bad += [(n, f) for n in nonfinite]
        except (ShardError, ValueError) as e:
            raise WeightLoadError(str(e)) from e
        for n, (f, digest) in got.items():
            if digest != tensors[n][HASH_NAME]:
                raise WeightLoadError(f"tensor {n} in {f} fails its checksum (corrupt shard): "
                                      f"{digest} != {tensors[n][HASH_NAME]} in {INDEX}")
        if bad:
            raise WeightLoadError(f"tensor {bad[0][0]} in {bad[0][1]} holds NaN or inf (non-finite weights"
                                  + (f"; {len(bad) - 1} more tensors too)" if len(bad) > 1 else ")"))
        return Received(state=state, hashes={n: m[HASH_NAME] for n, m in tensors.items()},
                          bytes=sum(nbytes(t) for t in state.values()), seconds=time.perf_counter() - t0,
                          num_skipped=len(tensors) - len(wanted), sums=index_sums(index))

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

    def load(self, path: str, *, expected: Mapping[str, torch.Tensor], known: Mapping[str, str],
             sums: Optional[Mapping[str, int]] = None) -> Received:
        return self.reader.load(Path(path), expected, known, sums)

    def close(self) -> None:
        self.reader.close()


def make_receiver(w, *, device=None) -> FilesystemReceiver:
    """TransportSpec.receiver: reads on the CPU (the engine copies onto its device)."""
    return FilesystemReceiver(w.num_hash_threads)
