"""Filesystem transport, trainer side: every rank writes its share of ``weights/step_N/``.

Weights come as a stream (workers/weights/stream.py): every rank iterates all tensors in the same
order (each a gather on a sharded model) and pwrites its share's into its shard file as they pass,
so no rank ever holds more than one full tensor; the files are byte for byte those a full state
dict gives (shards.ShardWriter). A delta step streams twice: once to hash, once for what changed.

The layout and the publish protocol (gathers, STABLE last, rename, delta mode, retention)
are in the package docstring (workers/weights/filesystem/__init__.py). NaN/inf in a written
tensor is found while it is hashed (shards.FiniteScan); gather #2 carries each rank's list,
so every rank refuses the step together (NonFiniteWeights) and nothing is renamed into place.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import shutil
import time
from pathlib import Path
from typing import Mapping, Optional, Union

import torch

from workers.common.atomic_dir import seal, temp_dir, temp_path, write_synced
from workers.common.protocol import STABLE, step_name
from workers.weights.base import (Peers, SoloPeers, SyncStats, TensorMeta, WeightPublisher, assign_shares, refuse_nonfinite)
from workers.weights.checksums import HASH_NAME, tensor_hash
from workers.weights.filesystem.hf_layout import HFFiles, hf_files
from workers.weights.filesystem.layout import FORMAT, INDEX, referenced_steps, shard_name
from workers.weights.shards import ShardWriter, dtype_from_name
from workers.weights.stream import WeightStream, as_stream


def _host(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.contiguous() if t.device.type == "cpu" else t.to("cpu", copy=True).contiguous()


class FilesystemPublisher(WeightPublisher):
    """Trainer side (the package docstring has the protocol and delta mode)."""

    def __init__(self, root: Path, *, peers: Peers, keep_last: int, delta: bool = False, full_every: int = 10,
                 skip_nonfinite: bool = False, hf: Optional[HFFiles] = None):
        assert keep_last >= 1 and full_every >= 1, (keep_last, full_every)
        self.root, self.peers, self.keep_last = Path(root), peers, keep_last
        self.delta, self.full_every = delta, full_every
        self.skip_nonfinite = skip_nonfinite  # NaN/inf in a step: skip it (True) or raise NonFiniteWeights
        self.hf = hf  # config.json, HF index and tokenizer files in every step (hf_layout.py); None: not an HF dir
        self._prev: dict[str, tuple[str, str]] = {}  # this rank's share: name -> (hash, file relative to root)
        self._last_full: Optional[int] = None
        # Deleting a GB-sized step costs as much as writing one (measured ~0.6 s/GB on tmpfs
        # here), so rank 0 prunes off the critical path; the next publish waits for it.
        self._pruner = cf.ThreadPoolExecutor(1, thread_name_prefix="weights-prune")
        self._pruning: Optional[cf.Future] = None
        self.index_extra: Optional[dict] = None
        """Rank 0: merged into the next step's index.json (a patch run's anchor: ``anchor`` and each
        tensor's ``sum64``, workers/weights/filesystem/patch_publisher.py), then cleared."""

    def publish(self, version: int, weights: Union[WeightStream, Mapping[str, torch.Tensor]]) -> SyncStats:
        """COLLECTIVE. ``weights``: a stream (gathered tensor by tensor; every rank iterates it
        whole, each writes its share's tensors into its file as they pass) or a full state dict."""
        t0 = time.perf_counter()
        stream = as_stream(weights)
        rank, world = self.peers.rank, self.peers.world_size
        self.wait_pruned()
        final = self.root / step_name(version)
        tmp = temp_path(final)
        metas = stream.metas
        mine = assign_shares(metas, world)[rank]
        if rank == 0:
            temp_dir(final, fresh=True)
        if world > 1:
            self.peers.all_gather_object(None)  # gather #1: the temp dir exists
        full = not self.delta or self._last_full is None or version - self._last_full >= self.full_every
        hashes: dict[str, str] = {}
        names = stream.names
        if full:
            to_write = mine
        else:  # the decision needs the hashes: a first pass hashes this rank's share as it streams by
            own = {m.name for m in mine}
            hashes = {n: tensor_hash(_host(t)) for n, t in stream.items() if n in own}
            to_write = [m for m in mine if self._prev.get(m.name, ("", ""))[0] != hashes[m.name]]
            changed = {n for part in self.peers.all_gather_object([m.name for m in to_write]) for n in part}
            names = [n for n in names if n in changed]  # the second pass gathers only what some rank rewrites
        fname = shard_name(rank, world, sharded=self.delta)  # delta: never model.safetensors (hf_layout.py)
        bad: list[str] = []  # tensors holding NaN/inf, found in the hashing pass
        hashes.update(self._write(tmp / fname, stream, names, to_write, {"format": "pt", "step": str(version)}, bad))
        written = {m.name for m in to_write}
        entries = {m.name: {"shape": list(m.shape), "dtype": m.dtype, HASH_NAME: hashes[m.name],
                            "file": f"{final.name}/{fname}" if m.name in written else self._prev[m.name][1]}
                   for m in mine}
        moved = sum(m.nbytes for m in to_write)
        gathered = self.peers.all_gather_object((entries, moved, bad))  # gather #2: every shard is on disk
        bad = sorted(n for _, _, b in gathered for n in b)
        if bad:  # every rank sees the same list: all refuse (or skip) together
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            refuse_nonfinite(version, bad, skip=self.skip_nonfinite)
            return SyncStats(bytes=0, seconds=time.perf_counter() - t0, skipped=True)
        if rank == 0:
            merged = {k: v for e, _, _ in gathered for k, v in e.items()}
            self._finish(version, tmp, final, metas, merged)
        self._prev = {n: (e[HASH_NAME], e["file"]) for n, e in entries.items()}
        if full:
            self._last_full = version
        return SyncStats(bytes=sum(b for _, b, _ in gathered), seconds=time.perf_counter() - t0)

    @staticmethod
    def _write(path: Path, stream: WeightStream, names: list[str], own: list[TensorMeta], metadata: dict,
               bad: list[str]) -> dict[str, str]:
        """Iterate ``names`` of ``stream`` (every rank the same: the gathers pair up) and write the
        ``own`` ones into ``path`` as they arrive; each gathered tensor is dropped once written, so
        a rank holds one full tensor at a time. No ``own`` tensor: no file (delta steps)."""
        writer = ShardWriter(path, [(m.name, dtype_from_name(m.dtype), m.shape) for m in own], metadata) \
            if own else None
        wanted = {m.name for m in own}
        try:
            for name, t in stream.items(names):
                if writer is not None and name in wanted:
                    writer.write(name, _host(t))
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        return writer.finish(bad) if writer is not None else {}

    def _finish(self, version: int, tmp: Path, final: Path, metas: list[TensorMeta], entries: dict) -> None:
        def rel(file: str) -> str:  # files are recorded relative to the weights root
            return file.split("/", 1)[1] if file.startswith(final.name + "/") else "../" + file

        index = {"format": FORMAT, "step": version, "metadata": {"total_size": sum(m.nbytes for m in metas)},
                 "weight_map": {m.name: rel(entries[m.name]["file"]) for m in metas},
                 "tensors": {m.name: {k: entries[m.name][k] for k in ("shape", "dtype", HASH_NAME)} for m in metas}}
        extra, self.index_extra = self.index_extra or {}, None
        for name, sums in extra.pop("tensor_fields", {}).items():
            for n, v in sums.items():
                index["tensors"][n][name] = v
        index.update(extra)
        if self.hf is not None:
            dtypes = sorted({m.dtype for m in metas if m.dtype.startswith(("float", "bfloat"))})
            self.hf.write(tmp, index["weight_map"], index["metadata"]["total_size"], dtypes[0] if dtypes else "float32")
        write_synced(tmp / INDEX, json.dumps(index).encode())
        seal(tmp, final, STABLE)  # STABLE last: it vouches for everything before it; then one rename
        self._pruning = self._pruner.submit(prune, self.root, keep_last=self.keep_last, newest=version)

    def wait_pruned(self) -> None:
        """Wait for the previous publish's retention pass (it runs in the background)."""
        if self._pruning is not None:
            self._pruning.result()
            self._pruning = None

    def close(self) -> None:
        self.wait_pruned()
        self._pruner.shutdown(wait=True)


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


def publish_step(weights_root: Path, step: int, state: Mapping[str, torch.Tensor], *, keep_last: int) -> dict:
    """One-rank publish (tools, tests, benchmarks): returns {bytes, seconds}."""
    pub = FilesystemPublisher(Path(weights_root), peers=SoloPeers(), keep_last=keep_last)
    try:
        out = pub.publish(step, state)
    finally:
        pub.close()
    return {"bytes": out.bytes, "seconds": out.seconds}


def filesystem_publisher(w, paths, peers: Peers, *, model=None) -> FilesystemPublisher:
    """The full-step publisher ``weights`` config ``w`` asks for (the broadcast transport's step 0 too; with
    ``weights.delta`` the patch publisher wraps it: patch_publisher.make_publisher); with the run's
    ``model`` section, every step is also a Hugging Face directory when the family has a config.json."""
    return FilesystemPublisher(paths.root / "weights", peers=peers, keep_last=w.keep_last, delta=w.delta_files,
                               full_every=w.delta_full_every,
                               skip_nonfinite=w.skip_nonfinite, hf=hf_files(model) if model is not None else None)
