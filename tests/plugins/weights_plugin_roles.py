"""The ``fake_copy`` test transport's three sides (protocol: tests/plugins/weights_plugin.py)."""
from __future__ import annotations

import collections
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch

from workers.common.protocol import write_json_atomic
from workers.weights.base import (Received, SyncStats, TensorMeta, WeightLoadError, WeightPublisher, check_fits,
                                  peers_for)
from workers.weights.checksums import state_hashes, xxh3_hex
from workers.weights.coordinator import WeightCoordinator, WeightUpdateError, swap_weights
from workers.weights.digest import state_digest
from workers.weights.filesystem.publisher import filesystem_publisher
from workers.weights.filesystem.receiver import FilesystemReceiver
from workers.weights.shards import dtype_from_name
from workers.weights.stream import WeightStream, as_stream

MANIFEST, COPIED, APPLIED = "manifest.json", "COPIED", "APPLIED.json"


def copy_root(run_dir, w) -> Path:
    return Path(run_dir) / w.copy_dir


def version_dir(root: Path, version: int) -> Path:
    return root / f"v_{version:06d}"


def newest_copy(root: Path) -> Optional[int]:
    """The newest complete version (COPIED present), or None."""
    got = [int(d.name[2:]) for d in root.glob("v_*") if d.name[2:].isdigit() and (d / COPIED).exists()]
    return max(got, default=None)


class CopyPublisher(WeightPublisher):
    def __init__(self, w, paths, peers):
        self.w, self.peers = w, peers
        self.root = copy_root(paths.root, w)
        self.initial = filesystem_publisher(w, paths, peers)  # step 0: workers boot from weights/step_0

    def publish(self, version: int, weights: Union[WeightStream, Mapping[str, torch.Tensor]]) -> SyncStats:
        stream = as_stream(weights)  # the trainer passes a stream: gathered tensor by tensor, every rank iterates
        if version == 0:
            return self.initial.publish(version, stream)
        t0, nbytes = time.perf_counter(), 0
        if self.peers.rank == 0:
            nbytes = self._write(version, stream)
        else:
            collections.deque(stream.items(), maxlen=0)  # join the gathers; rank 0 writes
        if self.peers.world_size > 1:
            self.peers.all_gather_object(None)  # the others wait until rank 0's copy is complete
        return SyncStats(bytes=nbytes, seconds=time.perf_counter() - t0)

    def _write(self, version: int, stream: WeightStream) -> int:
        final = version_dir(self.root, version)
        tmp = final.with_name(f".{final.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        rows = []
        for i, (name, t) in enumerate(stream.items()):
            t = t.detach().to("cpu").contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
            (tmp / f"{i}.bin").write_bytes(raw)
            rows.append({"name": name, "file": f"{i}.bin", "dtype": TensorMeta.of(name, t).dtype,
                         "shape": list(t.shape), "xxh3": xxh3_hex(raw)})
        digest = state_digest({r["name"]: r["xxh3"] for r in rows})
        (tmp / MANIFEST).write_text(json.dumps({"version": version, "digest": digest, "tensors": rows}))
        (tmp / COPIED).write_text(str(time.time()))  # last: it vouches for everything before it
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        for d in self.root.glob("v_*"):
            if d.name[2:].isdigit() and int(d.name[2:]) <= version - self.w.keep_last:
                shutil.rmtree(d, ignore_errors=True)
        return stream.nbytes

    def close(self) -> None:
        self.initial.close()


def make_publisher(cfg, paths, topology, *, rank: int, world_size: int, device=None) -> CopyPublisher:
    return CopyPublisher(cfg.weights, paths, peers_for(rank, world_size))


class CopyReceiver(FilesystemReceiver):
    """Reads ``v_N`` copies; anything else (weights/step_N of a revived worker) as the filesystem does."""

    transport = "fake_copy"

    def __init__(self, num_threads: int = 2):
        super().__init__(num_threads)
        self.num_copies_loaded = 0

    def load(self, path: str, *, expected: Mapping[str, torch.Tensor], known: Mapping[str, str],
             sums: Optional[Mapping[str, int]] = None) -> Received:
        d = Path(path)
        if not (d / MANIFEST).exists() and not d.name.startswith("v_"):
            return super().load(path, expected=expected, known=known, sums=sums)
        t0 = time.perf_counter()
        if not (d / COPIED).exists():
            raise WeightLoadError(f"{d} has no {COPIED} marker: the copy is not complete")
        rows = json.loads((d / MANIFEST).read_text())["tensors"]
        check_fits({r["name"]: r for r in rows}, expected, where=str(d))
        state, nbytes = {}, 0
        for r in rows:
            raw = (d / r["file"]).read_bytes()
            if xxh3_hex(raw) != r["xxh3"]:
                raise WeightLoadError(f"tensor {r['name']} in {d / r['file']} fails its checksum")
            state[r["name"]] = torch.frombuffer(bytearray(raw), dtype=dtype_from_name(r["dtype"])).reshape(r["shape"])
            nbytes += len(raw)
        self.num_copies_loaded += 1
        return Received(state=state, hashes={r["name"]: r["xxh3"] for r in rows}, bytes=nbytes,
                        seconds=time.perf_counter() - t0)


def make_receiver(w, *, device=None) -> CopyReceiver:
    return CopyReceiver(w.num_hash_threads)


class FakeCopyCoordinator(WeightCoordinator):
    def __init__(self, cfg: Any, paths: Any, *, log: Any):
        super().__init__(cfg, paths, log=log)
        self.root = copy_root(paths.root, cfg.weights)

    async def maybe_update(self, pool: Any) -> None:
        newest = newest_copy(self.root)
        if newest is None or newest <= self.version:
            return
        d = version_dir(self.root, newest)
        live = pool.live_clients()
        try:
            swap = await swap_weights(live, newest, lambda c: c.update_weights_from_disk(str(d), newest))
        except WeightUpdateError as e:  # keep the old version; the next turn retries the newest copy
            self.log.warning("%s", e)
            await pool.check_live()
            return
        expected = json.loads((d / MANIFEST).read_text())["digest"]
        ok = all(x == expected for x in swap.digests)
        write_json_atomic(d / APPLIED, {"version": newest, "ok": ok, "digests": swap.digests, "expected": expected})
        self.update_s, self.version = swap.seconds, newest
        self.verify(newest, live, swap.digests, expected)
        self.log.info("fake_copy: workers at v%d (digests %s)", newest, "match" if ok else "DIFFER")


def reference_digest(state: Mapping[str, torch.Tensor]) -> str:
    """What a worker holding ``state`` reports (tests)."""
    return state_digest(state_hashes(state))

