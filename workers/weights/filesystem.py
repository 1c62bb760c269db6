"""Filesystem weight transport: trainer ranks publish ``weights/step_N/``, inference loads it.

One step on disk (HF layout; ``model.safetensors`` when one rank writes)::

    step_000007/model-00001-of-00002.safetensors   rank 0's share of the tensors
    step_000007/model-00002-of-00002.safetensors   rank 1's share
    step_000007/index.json   {"format", "step", "metadata": {"total_size"},
                              "weight_map": {name: file, relative to this dir},
                              "tensors": {name: {"shape", "dtype", "xxh3"}}}
    step_000007/STABLE       written last

Publish protocol (every trainer rank calls :meth:`FilesystemPublisher.publish`; waits are
the trainer group's collectives, bounded by its process-group timeout):
  1. rank 0 empties ``.step_N.tmp/``; gather #1 (everyone knows the dir exists);
  2. rank r writes its share (:func:`assign_shares`: by bytes, the same split every step)
     to ``<shard>.partial``, hashing each chunk as it is written (shards.py), fsyncs,
     renames to ``<shard>``; gather #2 brings every rank's {name: shape, dtype, hash, file};
  3. rank 0 writes index.json, then STABLE, fsyncs, renames ``.step_N.tmp`` -> ``step_N``
     (readers never see a partial step), then prunes old steps in a background thread
     (the next publish, and close(), wait for it).

Delta mode (``weights.delta``): a rank writes only tensors whose hash changed since its
previous publish; index.json then points unchanged tensors at the file that holds them,
in an earlier step (``../step_000005/model-00001-of-00002.safetensors``). Every
``delta_full_every`` steps (and after a restart) a full step cuts the chain. Retention keeps
the newest ``keep_last`` steps plus every step one of them references, so a kept index
never points at a deleted file; once a full step is among the kept ones, old steps go.

Load (:class:`DiskReader`, inference side): refuses a missing dir, a missing STABLE, an
unreadable index, a truncated, absent or mis-described shard, a checksum mismatch and a
name or shape that does not fit the model, with :class:`WeightLoadError` naming the file
and tensor; nothing is applied then. Tensors whose hash equals what the worker holds are
not read at all (delta steps cost only their changed bytes on the read side too).
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Mapping, Optional

import torch

from workers.common.protocol import STABLE, step_name
from workers.weights.base import Peers, SoloPeers, SyncStats, TensorMeta, WeightLoadError, WeightPublisher, assign_shares
from workers.weights.checksums import HASH_NAME, Hasher, tensor_hash  # noqa: F401  (tensor_hash re-exported)
from workers.weights.shards import ShardError, Staging, aligned_size, meta_nbytes, nbytes, read_tensors, write_shard

INDEX = "index.json"
FORMAT = "slurmrl-weights/1"


def shard_name(rank: int, world: int) -> str:
    return "model.safetensors" if world == 1 else f"model-{rank + 1:05d}-of-{world:05d}.safetensors"


def _host(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.contiguous() if t.device.type == "cpu" else t.to("cpu", copy=True).contiguous()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FilesystemPublisher(WeightPublisher):
    """Trainer side (see the module docstring for the protocol and delta mode)."""

    def __init__(self, root: Path, *, peers: Peers, keep_last: int, delta: bool = False, full_every: int = 10,
                 num_threads: int = 2):
        assert keep_last >= 1 and full_every >= 1, (keep_last, full_every)
        self.root, self.peers, self.keep_last = Path(root), peers, keep_last
        self.delta, self.full_every = delta, full_every
        self.hasher = Hasher(num_threads)
        self._prev: dict[str, tuple[str, str]] = {}  # this rank's share: name -> (hash, file relative to root)
        self._last_full: Optional[int] = None
        # Deleting a GB-sized step costs as much as writing one (measured ~0.6 s/GB on tmpfs
        # here), so rank 0 prunes off the critical path; the next publish waits for it.
        self._pruner = cf.ThreadPoolExecutor(1, thread_name_prefix="weights-prune")
        self._pruning: Optional[cf.Future] = None

    def publish(self, version: int, state: Mapping[str, torch.Tensor]) -> SyncStats:
        t0 = time.perf_counter()
        rank, world = self.peers.rank, self.peers.world_size
        self.wait_pruned()
        final = self.root / step_name(version)
        tmp = self.root / f".{final.name}.tmp"
        metas = [TensorMeta.of(n, t) for n, t in state.items()]
        mine = assign_shares(metas, world)[rank]
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        if world > 1:
            self.peers.all_gather_object(None)  # gather #1: the temp dir exists
        tensors = [(m.name, _host(state[m.name])) for m in mine]
        full = not self.delta or self._last_full is None or version - self._last_full >= self.full_every
        hashes: dict[str, str] = {}
        if full:
            to_write = tensors
        else:  # the decision needs the hashes first (in threads; not overlapped with the write)
            hashes = {n: f.result() for n, f in self.hasher.hash_tensors(tensors).items()}
            to_write = [(n, t) for n, t in tensors if self._prev.get(n, ("", ""))[0] != hashes[n]]
        fname = shard_name(rank, world)
        if to_write:
            hashes.update(write_shard(tmp / fname, to_write, {"format": "pt", "step": str(version)}))
        written = {n for n, _ in to_write}
        entries = {m.name: {"shape": list(m.shape), "dtype": m.dtype, HASH_NAME: hashes[m.name],
                            "file": f"{final.name}/{fname}" if m.name in written else self._prev[m.name][1]}
                   for m in mine}
        moved = sum(nbytes(t) for _, t in to_write)
        gathered = self.peers.all_gather_object((entries, moved))  # gather #2: every shard is on disk
        if rank == 0:
            merged = {k: v for e, _ in gathered for k, v in e.items()}
            self._finish(version, tmp, final, metas, merged)
        self._prev = {n: (e[HASH_NAME], e["file"]) for n, e in entries.items()}
        if full:
            self._last_full = version
        return SyncStats(bytes=sum(b for _, b in gathered), seconds=time.perf_counter() - t0)

    def _finish(self, version: int, tmp: Path, final: Path, metas: list[TensorMeta], entries: dict) -> None:
        def rel(file: str) -> str:  # files are recorded relative to the weights root
            return file.split("/", 1)[1] if file.startswith(final.name + "/") else "../" + file

        index = {"format": FORMAT, "step": version, "metadata": {"total_size": sum(m.nbytes for m in metas)},
                 "weight_map": {m.name: rel(entries[m.name]["file"]) for m in metas},
                 "tensors": {m.name: {k: entries[m.name][k] for k in ("shape", "dtype", HASH_NAME)} for m in metas}}
        for name, text in ((INDEX, json.dumps(index)), (STABLE, json.dumps({"time": time.time()}))):
            with open(tmp / name, "w") as f:  # STABLE last: it vouches for everything before it
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        self._pruning = self._pruner.submit(prune, self.root, keep_last=self.keep_last, newest=version)

    def wait_pruned(self) -> None:
        """Wait for the previous publish's retention pass (it runs in the background)."""
        if self._pruning is not None:
            self._pruning.result()
            self._pruning = None

    def close(self) -> None:
        self.wait_pruned()
        self._pruner.shutdown(wait=True)
        self.hasher.close()


def referenced_steps(step_dir: Path) -> set[str]:
    """Names of the earlier step dirs whose files ``step_dir``'s index points at."""
    try:
        weight_map = json.loads((step_dir / INDEX).read_text())["weight_map"]
    except (OSError, ValueError, KeyError):
        return set()
    return {f.split("/")[1] for f in weight_map.values() if f.startswith("../")}


def prune(weights_root: Path, *, keep_last: int, newest: int) -> list[str]:
    """Delete steps older than the newest ``keep_last`` that no kept step references.

    Also removes temp dirs of steps older than ``newest`` (a rank died mid-publish).
    Returns the names deleted.
    """
    steps = {d.name: int(d.name[5:]) for d in weights_root.iterdir() if d.name.startswith("step_")
             and d.name[5:].isdigit()}
    kept = {name for name, s in steps.items() if s > newest - keep_last}
    for name in list(kept):
        kept |= referenced_steps(weights_root / name)
    gone = [name for name, s in steps.items() if name not in kept and s < newest]
    gone += [d.name for d in weights_root.glob(".step_*.tmp") if d.name[6:-4].isdigit() and int(d.name[6:-4]) < newest]
    for name in gone:
        shutil.rmtree(weights_root / name, ignore_errors=True)
    return sorted(gone)


@dataclasses.dataclass
class LoadedStep:
    state: dict[str, torch.Tensor]
    """The tensors read (views into the reader's staging buffer, valid until its next load)."""
    hashes: dict[str, str]
    """Every tensor of the step (read or skipped) -> its digest: what the worker holds after applying."""
    bytes: int
    seconds: float
    num_skipped: int


class DiskReader:
    """Inference side: verify a published step and read it into a reusable staging buffer."""

    def __init__(self, num_threads: int = 2):
        self.staging = Staging("cpu")
        self._io = cf.ThreadPoolExecutor(num_threads, thread_name_prefix="weights-read")  # one shard per thread

    def load(self, step_dir: Path, expected: Optional[Mapping[str, torch.Tensor]] = None,
             known: Optional[Mapping[str, str]] = None) -> LoadedStep:
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
        return LoadedStep(state=state, hashes={n: m[HASH_NAME] for n, m in tensors.items()},
                          bytes=sum(nbytes(t) for t in state.values()), seconds=time.perf_counter() - t0,
                          num_skipped=len(tensors) - len(wanted))

    def close(self) -> None:
        self._io.shutdown(wait=True)


def check_fits(tensors: Mapping[str, Mapping], expected: Mapping[str, torch.Tensor], *, where: str) -> None:
    """Names and shapes of an update ({name: {"shape": ...}}) against the model's parameters."""
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise WeightLoadError(f"{where} lacks {len(missing)} model tensors, e.g. {missing[:3]}")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise WeightLoadError(f"{where} has {len(extra)} tensors the model does not, e.g. {extra[:3]}")
    for name, cur in expected.items():
        if list(tensors[name]["shape"]) != list(cur.shape):
            raise WeightLoadError(f"tensor {name}: published shape {tuple(tensors[name]['shape'])} != model shape "
                                  f"{tuple(cur.shape)} (in {where})")


def publish_step(weights_root: Path, step: int, state: Mapping[str, torch.Tensor], *, keep_last: int) -> dict:
    """One-rank publish (tools, tests, benchmarks): returns {bytes, seconds}."""
    pub = FilesystemPublisher(Path(weights_root), peers=SoloPeers(), keep_last=keep_last)
    try:
        out = pub.publish(step, state)
    finally:
        pub.close()
    return {"bytes": out.bytes, "seconds": out.seconds}


def load_step(step_dir: Path, expected: Optional[Mapping[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
    """Read and verify a whole published step (tools and tests); raises WeightLoadError."""
    reader = DiskReader()
    try:
        return reader.load(Path(step_dir), expected).state
    finally:
        reader.close()
