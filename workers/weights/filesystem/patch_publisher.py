"""Filesystem transport with sparse patches (``weights.delta=true``): a step on disk holds what changed.

Layout of a patch step (anchors are ordinary full steps, whose index.json adds ``anchor`` and each
tensor's ``sum64``)::

    step_000008/patch-00001-of-00002.safetensors   rank 0's parts (absent when it changed nothing)
    step_000008/index.json   {"format": "slurmrl-delta/1", "step": 8, "base": 7, "anchor": 5,
                              "tensors": {name: {"shape", "dtype", "sum64",
                                                 "parts": [{"file", "key", "encoding", "count", "lo",
                                                            "hi", "xxh3"}]}},
                              "stats": {"changed", "compared", "bytes", "dense_bytes"}}
    step_000008/STABLE

Protocol for version V (T: every trainer rank; the orchestrator and workers as for full steps):
  T  main thread (what training waits for): NaN/inf check of the local shards (gathered: every rank
     decides alike), then the tracker's diff on the device (tracker.py), encoded on the host, and one
     small gather of every rank's part manifest and sum64 changes. Then it returns to training.
  T  background thread (up to two publishes queued, written in version order): each rank writes
     its blob into ``.step_V.tmp/`` and a ``.rank-R.done`` marker; rank 0 waits for every marker
     (deadline ``weights.publish_timeout_s``), writes index.json then STABLE, renames the dir into
     place and prunes (keeping every step a kept step's chain needs: anchor .. step).
  Anchors (the first publish, every ``weights.delta_full_every`` versions): the snapshot is reset and
     a full step written; on one rank holding every tensor whole it is written from a copy of the
     snapshot in the background, otherwise synchronously through the gathered stream.
  Anchors out of turn: a step the orchestrator refused (damaged on disk) is answered by a full step of
     the newest version at once, while the trainer waits for its next batch (reanchor.py).
A background failure is raised by a later publish (or close): the run stops with it, as a failed
synchronous publish would.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import time
from pathlib import Path
from typing import Any, Optional

from workers.common.atomic_dir import seal, temp_dir, write_synced
from workers.common.protocol import STABLE, PeerTimeout, step_name, wait_for
from workers.weights.base import SyncStats, WeightPublisher, refuse_nonfinite
from workers.weights.delta import DIGEST, FORMAT
from workers.weights.delta.patch import encode
from workers.weights.delta.sum64 import MASK, hex64
from workers.weights.delta.tracker import DeltaTracker
from workers.weights.filesystem.layout import INDEX
from workers.weights.base import peers_for
from workers.weights.filesystem.publisher import FilesystemPublisher, filesystem_publisher, prune
from workers.weights.filesystem.reanchor import read_request
from workers.weights.stream import DictStream, as_stream


MAX_IN_FLIGHT = 2
"""Background publishes queued at once (one thread, version order): the trainer waits only when the
disk falls two versions behind."""


def patch_name(rank: int, world: int) -> str:
    return f"patch-{rank + 1:05d}-of-{world:05d}.safetensors"


class PatchStats(SyncStats):
    """SyncStats plus what a patch publish adds to metrics.jsonl (issue 31's per-update metrics)."""

    def __init__(self, *, extra: dict[str, Any], **kw):
        super().__init__(**kw)
        self.extra = extra

    def metrics(self) -> dict[str, Any]:
        return {**super().metrics(), **self.extra}


class PatchPublisher(WeightPublisher):
    """Trainer side of ``weights.delta`` on the filesystem (module docstring)."""

    def __init__(self, full: FilesystemPublisher, *, full_every: int, snapshot: str = "device",
                 publish_async: bool = True, timeout_s: float = 600.0):
        self.full, self.peers, self.root = full, full.peers, full.root
        self.full_every, self.on_host, self.timeout_s = full_every, snapshot == "host", timeout_s
        self.tracker: Optional[DeltaTracker] = None
        self.totals: dict[str, int] = {}  # rank 0: every tensor's sum64 at the last published version
        self.last_anchor: Optional[int] = None
        self.last_version: Optional[int] = None
        self._bg = cf.ThreadPoolExecutor(1, thread_name_prefix="weights-publish") if publish_async else None
        self._pending: list[cf.Future] = []  # background publishes in version order (at most MAX_IN_FLIGHT)
        self._done: dict[str, Any] = {}  # the last finished background publish: version, total seconds
        self._stream = None  # the last published version's stream (the model has not moved until the next step)
        self.handled_seq = 0  # the newest re-anchor request acted on (reanchor.py)
        self.reanchors = 0  # anchors written out of turn for a refused step

    def publish(self, version: int, weights) -> SyncStats:
        t0 = time.perf_counter()
        self._reap()  # finished background publishes: their errors surface here
        stream = as_stream(weights)
        rank, world = self.peers.rank, self.peers.world_size
        if refuse_nonfinite(version, stream.local_nonfinite(), skip=self.full.skip_nonfinite, peers=self.peers):
            blocked = time.perf_counter() - t0
            return PatchStats(bytes=0, seconds=blocked, skipped=True, extra=self._metrics(0.0, 0, blocked))
        if self.tracker is None:
            self.tracker = DeltaTracker(stream, stream.metas, self.peers, on_host=self.on_host)
        self.tracker.rebind(stream)
        dense = stream.nbytes
        anchor = self.last_anchor is None or version - self.last_anchor >= self.full_every
        if anchor:
            self._anchor(version, stream)
            frac = 1.0
        else:
            raw, dsum, compared = self.tracker.diff(split=False)  # on the device; changes copied to the host
            changed = sum(int(g.numel()) for _, g, _ in raw)
            frac = changed / max(compared, 1)
            self._submit(self._write_patch, version, stream.metas, raw, dsum, compared, changed, dense, rank, world,
                         self.last_version, self.last_anchor)
        self.last_version, self._stream = version, stream
        blocked = time.perf_counter() - t0
        return PatchStats(bytes=0 if not anchor else dense, seconds=blocked,
                          extra=self._metrics(frac, dense, blocked, anchor=anchor))

    def _metrics(self, frac: float, dense: int, blocked: float, *, anchor: bool = False) -> dict[str, Any]:
        """Per update: changed fraction (this rank's shards), dense bytes, seconds training was blocked,
        and the last background publish that finished (its version, bytes written by all ranks and
        total seconds: ``weight_published_*``, ``weight_publish_total_s``)."""
        return {"weight_changed_frac": frac, "weight_dense_bytes": dense, "weight_anchor": int(anchor),
                "weight_blocked_s": blocked, "weight_reanchors_total": self.reanchors,
                **{f"weight_{k}": v for k, v in self._done.items()}}

    def wait(self, ready, *, timeout_s: float, what: str) -> None:
        """The trainer waiting for a batch; meanwhile a request for a full step (the orchestrator refused
        one: reanchor.py) is answered at once. Every poll is one all-gather among the trainer ranks, as
        the broadcast publisher's: the out-of-turn anchor is collective, so all ranks decide on the same views."""
        deadline = time.monotonic() + timeout_s
        while True:
            seen = (bool(ready()), *read_request(self.root))
            views = self.peers.all_gather_object(seen) if self.peers.world_size > 1 else [seen]
            _, seq, refused, patch = min(views, key=lambda v: v[1])  # the newest request every rank has seen
            if seq > self.handled_seq:
                self.handled_seq = seq
                if self.reanchor_due(refused, patch):
                    continue
            if all(r for r, *_ in views):
                return
            if time.monotonic() > deadline:
                raise PeerTimeout(f"trainer rank {self.peers.rank}: no {what} from the orchestrator within "
                                  f"{timeout_s:.0f}s; is it alive? see its log")
            time.sleep(0.02 if self.peers.world_size == 1 else 0.1)

    def reanchor_due(self, refused: int, patch: bool) -> bool:
        """COLLECTIVE. Publish the newest version again as a full step when the refused version belongs to
        the current chain: a patch after the last anchor, or the anchor itself; True when it did. (A patch
        at or before the last anchor was already replaced by it.)"""
        if self.last_version is None or self._stream is None or self.last_anchor is None:
            return False
        if refused < self.last_anchor or (refused == self.last_anchor and patch):
            return False
        self.flush()  # the refused step may still be queued: the anchor replaces it, in order
        self._anchor(self.last_version, self._stream)
        self.reanchors += 1
        return True

    def _anchor(self, version: int, stream) -> None:
        """Write a full step (background where one rank holds it all). The first time the snapshot is
        taken and every sum64 computed; after that a diff brings snapshot and sums up to date (O(changed))."""
        if self.peers.world_size > 1:
            self.flush()  # the full step is written in order, through collectives on this thread
        if self.tracker.snap:
            _, partial, _ = self.tracker.diff(split=False)  # sum64 changes only: this version is written in full
            gathered = self.peers.all_gather_object(partial) if self.peers.world_size > 1 else [partial]
            for g in gathered:
                for n, v in g.items():
                    self.totals[n] = (self.totals[n] + v) & MASK
        else:
            partial = self.tracker.reset()
            gathered = self.peers.all_gather_object(partial) if self.peers.world_size > 1 else [partial]
            self.totals = {n: sum(g.get(n, 0) for g in gathered) & MASK for n in partial}
        totals = self.totals
        self.last_anchor = version
        extra = {"anchor": version, "tensor_fields": {DIGEST: {n: hex64(v) for n, v in totals.items()}}}
        full = self.tracker.full_values() if self.peers.world_size == 1 else None
        if self.peers.rank == 0:
            self.full.index_extra = extra
        if full is not None and self._bg is not None and self.peers.world_size == 1:
            self._submit(self._write_full, version, DictStream(full))
        else:
            self._write_full(version, stream if full is None else DictStream(full))

    def _write_full(self, version: int, stream) -> None:
        t0 = time.perf_counter()
        nbytes = self.full.publish(version, stream).bytes
        self._done = {"publish_total_s": time.perf_counter() - t0, "published_version": version,
                      "published_bytes": nbytes, "published_dense_bytes": nbytes}

    def _write_patch(self, version: int, metas, raw, dsum, compared: int, changed: int, dense: int, rank: int,
                     world: int, base: int, anchor: int) -> None:
        """Background: split, encode and write this rank's parts and its summary; rank 0 then waits for
        every rank's, writes index.json and STABLE and renames the step into place (no collective here)."""
        t0 = time.perf_counter()
        final = self.root / step_name(version)
        tmp = temp_dir(final)  # every rank's parts go into the one temp dir (rank 0 seals it)
        blob, manifest = encode(self.tracker.split(raw), self.tracker.numels)
        if blob:
            write_synced(tmp / patch_name(rank, world), blob)
        summary = {"manifest": manifest, "dsum": {n: hex64(v) for n, v in dsum.items()}, "compared": compared,
                   "changed": changed, "bytes": len(blob)}
        write_synced(tmp / f".rank-{rank}.json", json.dumps(summary).encode())
        write_synced(tmp / f".rank-{rank}.done", b"")
        if rank != 0:
            return
        markers = [tmp / f".rank-{r}.done" for r in range(world)]
        wait_for(lambda: all(m.exists() for m in markers), timeout_s=self.timeout_s,
                 what=f"every trainer rank's patch of weights step {version}", peer="trainer ranks", poll_s=0.01)
        summaries = [json.loads((tmp / f".rank-{r}.json").read_text()) for r in range(world)]
        for r in range(world):
            (tmp / f".rank-{r}.json").unlink()
            markers[r].unlink()
        index = self._index(version, metas, summaries, dense, base, anchor)
        write_synced(tmp / INDEX, json.dumps(index).encode())
        self._place(tmp, final)
        self.full.wait_pruned()
        prune(self.root, keep_last=self.full.keep_last, newest=version)
        self._done = {"publish_total_s": time.perf_counter() - t0, "published_version": version,
                      "published_bytes": index["stats"]["bytes"], "published_dense_bytes": dense,
                      "published_changed_frac": index["stats"]["changed"] / max(index["stats"]["compared"], 1)}

    def _place(self, tmp: Path, final: Path) -> None:
        """STABLE, then rename the finished patch step into place (readers see all of it or nothing)."""
        seal(tmp, final, STABLE)

    def _index(self, version: int, metas, summaries: list[dict], dense: int, base: int, anchor: int) -> dict:
        """Rank 0: the step's index.json (sum64 totals advanced by every rank's changes)."""
        for sm in summaries:
            for n, v in sm["dsum"].items():
                self.totals[n] = (self.totals[n] + int(v, 16)) & MASK
        world = len(summaries)
        tensors = {m.name: {"shape": list(m.shape), "dtype": m.dtype, DIGEST: hex64(self.totals[m.name]), "parts": []}
                   for m in metas}
        for r, sm in enumerate(summaries):
            for n, entries in sm["manifest"].items():
                tensors[n]["parts"] += [{**e, "file": patch_name(r, world)} for e in entries]
        stats = {k: sum(sm[k] for sm in summaries) for k in ("changed", "compared", "bytes")}
        return {"format": FORMAT, "step": version, "base": base, "anchor": anchor, "tensors": tensors,
                "stats": {**stats, "dense_bytes": dense}}

    def _submit(self, fn, *args) -> None:
        if self._bg is None:
            fn(*args)
            return
        while len(self._pending) >= MAX_IN_FLIGHT:  # bounded: host copies of the changes wait here
            self._pending.pop(0).result()
        self._pending.append(self._bg.submit(fn, *args))

    def _reap(self) -> None:
        """Drop finished background publishes, re-raising the first error."""
        while self._pending and self._pending[0].done():
            self._pending.pop(0).result()

    def flush(self) -> None:
        """Block until every publish in flight is on disk (re-raising the first error)."""
        while self._pending:
            self._pending.pop(0).result()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            if self._bg is not None:
                self._bg.shutdown(wait=True)
            self.full.close()





def make_publisher(cfg, paths, topology, *, rank: int, world_size: int, device=None) -> WeightPublisher:
    """TransportSpec.publisher: this trainer rank's publisher into ``run_dir/weights``: full steps, or
    anchors and patches with ``weights.delta``."""
    w = cfg.weights
    full = filesystem_publisher(w, paths, peers_for(rank, world_size), model=cfg.model)
    if not w.delta:
        return full
    return PatchPublisher(full, full_every=w.delta_full_every, snapshot=w.delta_snapshot, publish_async=w.publish_async)
