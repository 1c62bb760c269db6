"""Broadcast into SGLang servers, trainer side: trainer rank 0 is rank 0 (``src=0``) of SGLang's group.

The wire protocol is SGLang's own (wire.py); who waits for whom is the package
docstring's "SGLang servers" part. What this module adds:

- Streaming from sharded ranks: every trainer rank walks the same batches in the same order
  and asks the weight stream (workers/weights/stream.py) for each batch's tensors (a gather
  each on a sharded model); only rank 0 keeps them, casts them to ``inference.dtype`` and
  broadcasts them.
  At most two batches are alive on rank 0 (the one on the wire and the one being gathered),
  never the whole model.
- Verification data: for the tensors :func:`~wire.sample_names` picks for this
  version, rank 0 records what ``/get_weights_by_name`` must answer (the values it sent)
  into ``samples.json``; the orchestrator reads the servers back and writes ``verdict.json``.
- Fallback: on a verdict of mismatch (or a failed update) every rank publishes the same
  version through the filesystem (``weights/step_V``), which the orchestrator then loads
  with ``/update_weights_from_disk``.
"""
from __future__ import annotations

import collections
import logging
import time
from typing import Optional

import torch
import torch.distributed as dist

from workers.common.ports import free_port
from workers.common.protocol import PeerTimeout, RunPaths
from workers.weights.base import Peers, SyncStats, TensorMeta, WeightPublisher
from workers.weights.checksums import buffer_checksum
from workers.weights.broadcast.delta_wire import PatchSender, patch_payload
from workers.weights.broadcast.group import backend_for
from workers.weights.sglang.patch_loader import FUSED_ROWS, descriptor_tensor
from workers.weights.broadcast.group_publisher import GroupPublisher
from workers.weights.sglang.wire import (Batch, close_update_group, flat_offsets, metas_json,
                                         open_update_group, plan_batches, sample_names, sample_value)
from workers.weights.shards import dtype_from_name
from workers.weights.stream import WeightStream, meta_of

log = logging.getLogger("slurmrl.weights")
SAMPLES_FILE, VERDICT_FILE = "samples.json", "verdict.json"
PATCH_FILE, VERDICTS_DIR = "patch.json", "loader_verdicts"
"""weights.delta: rank 0's descriptor of patch V {version, entry} (the orchestrator posts ``entry`` to
every server rank), and where each server rank's loader writes its outcome."""


def descriptor_shapes(parts, shapes: dict[str, list[int]]) -> dict[str, list[int]]:
    """Shapes the loaders need: every patched tensor's, and its siblings' where SGLang fuses rows."""
    out = {}
    for name in parts:
        out[name] = shapes[name]
        prefix, _, leaf = name.rpartition(".")
        mod, _, piece = prefix.rpartition(".")
        for part, _, order in FUSED_ROWS:
            if piece == part:
                out.update({f"{mod}.{p}.{leaf}": shapes[f"{mod}.{p}.{leaf}"] for p in order
                            if f"{mod}.{p}.{leaf}" in shapes})
    return out


class SGLangSender:
    """Streams one update through SGLang's group. Every trainer rank calls :meth:`send`; only
    rank 0 (``pg`` set) broadcasts."""

    def __init__(self, pg, batches: list[Batch], *, load_format: str, device: torch.device, timeout_s: float):
        self.pg, self.batches, self.load_format = pg, batches, load_format
        self.device, self.timeout_s = torch.device(device), timeout_s
        self.bytes = sum(b.nbytes for b in batches)


    def _start(self, batch: Batch, tensors: list[torch.Tensor]) -> tuple[list, list[torch.Tensor]]:
        """Post the batch's broadcasts (async); returns (works, tensors to keep alive until they finish)."""
        if self.load_format == "per_tensor":
            return [dist.broadcast(t, src=0, group=self.pg, async_op=True) for t in tensors], tensors
        flat = torch.empty(batch.nbytes, dtype=torch.uint8, device=self.device)
        for m, off, t in zip(batch.metas, flat_offsets(batch), tensors):
            flat[off: off + m.nbytes].copy_(t.reshape(-1).view(torch.uint8))
        return [dist.broadcast(flat, src=0, group=self.pg, async_op=True)], [flat]

    def send(self, stream: WeightStream, samples: set[str], rows: int) -> dict[str, list]:
        """Send every batch; returns {name: expected /get_weights_by_name answer} for ``samples`` (rank 0)."""
        expected: dict[str, list] = {}
        pending: collections.deque = collections.deque()
        for batch in self.batches:
            tensors = stream.items([m.name for m in batch.metas])  # gathers: every rank, same order
            if self.pg is None:
                collections.deque(tensors, maxlen=0)  # join the gathers, keep nothing
                continue
            tensors = [t.to(device=self.device, dtype=dtype_from_name(m.dtype)).contiguous()
                       for m, (_, t) in zip(batch.metas, tensors, strict=True)]
            for m, t in zip(batch.metas, tensors):
                if m.name in samples:
                    expected[m.name] = sample_value(t, rows)
            pending.append((batch.index, *self._start(batch, tensors)))
            while len(pending) > 1:  # one batch on the wire while the next is gathered
                self._finish(pending.popleft())
        while pending:
            self._finish(pending.popleft())
        return expected

    def _finish(self, item) -> None:
        index, works, _ = item
        for w in works:
            try:
                w.wait()
            except Exception as e:  # gloo raises on a timeout or a receiver that went away
                raise PeerTimeout(f"SGLang weight group: batch {index} not received by every server rank "
                                  f"({type(e).__name__}: {str(e).strip()[:200]}); see the servers' logs") from e


class SGLangBroadcastPublisher(GroupPublisher):
    """Trainer side of broadcast into SGLang; ``initial`` (filesystem) publishes step 0 and fallbacks."""

    def __init__(self, paths: RunPaths, cfg, peers: Peers, *, initial: WeightPublisher, host: str, port: int,
                 num_receivers: int, inference_dtype: str, device: Optional[torch.device] = None):
        super().__init__(paths, cfg, peers, initial=initial, host=host, port=port, num_receivers=num_receivers,
                         device=device)
        self.inference_dtype = inference_dtype
        self.sender: Optional[SGLangSender] = None
        self.patcher: Optional[PatchSender] = None  # weights.delta (delta_wire.py; applied by patch_loader.py)
        self.chain: Optional[int] = None  # the version every server holds (None: the next goes whole)
        self.anchor_version = 0  # the servers' last full load: their loader recomputes digests after one
        self.disk_anchor = 0  # the newest full step written to run_dir/weights (recovery: fresh servers load it)
        self.shapes: dict[str, list[int]] = {}
        self.last_patch: tuple[int, int] = (0, 0)  # (elements changed, compared) on this rank, last patch

    def publish(self, version: int, weights) -> SyncStats:
        first = not self.formed
        out = super().publish(version, weights)
        if first and self.patcher is not None:
            self.chain = self.anchor_version = self.disk_anchor = version
        return out

    @property
    def formed(self) -> bool:
        return self.sender is not None

    def _metas(self, stream: WeightStream) -> list[TensorMeta]:
        """What goes on the wire: floating tensors in inference.dtype (what the servers hold)."""
        out = []
        for m in stream.metas:
            dtype = self.inference_dtype if dtype_from_name(m.dtype).is_floating_point else m.dtype
            out.append(meta_of(m.name, m.shape, dtype_from_name(dtype), None))
        return out

    def _update(self, version: int, stream: WeightStream) -> SyncStats:
        samples = set(sample_names(stream.names, self.cfg.verify_fraction, version))
        patchable = self.patcher is not None and self.chain == version - 1  # anchors go to disk, not to servers
        if self.peers.rank == 0:
            self.handshake.offer(version, delta=patchable)
        t0 = time.perf_counter()
        if not self._wait(lambda: self.handshake.requested() == version, f"request of weights v{version}"):
            self.finished = True
            return SyncStats(bytes=0, seconds=0.0, wait_s=time.perf_counter() - t0, skipped=True)
        t1 = time.perf_counter()
        if patchable and self.handshake.requested_mode() == "delta":
            return self._patch(version, stream, wait_s=t1 - t0)
        expected = self.sender.send(stream, samples, self.cfg.verify_rows)
        seconds = time.perf_counter() - t1
        verdict = None
        if self.peers.rank == 0:
            self.handshake.write_marker(SAMPLES_FILE, {"version": version, "rows": self.cfg.verify_rows,
                                                 "expected": expected})
            self._wait(lambda: (self.handshake.read_marker(VERDICT_FILE) or {}).get("version") == version,
                       f"verdict on weights v{version}")
            verdict = self.handshake.read_marker(VERDICT_FILE)
        if self.peers.world_size > 1:
            verdict = self.peers.all_gather_object(verdict)[0]
            seconds = max(self.peers.all_gather_object(seconds))
        stats = SyncStats(bytes=self.sender.bytes, seconds=seconds, wait_s=t1 - t0)
        if verdict is not None and not verdict.get("ok", False):
            log.warning("weights v%d: SGLang servers did not take the broadcast (%s); publishing it through the "
                        "filesystem instead", version, verdict.get("why", "?"))
            stats = self.initial.publish(version, stream)  # the orchestrator loads it with /update_weights_from_disk
        if self.patcher is not None:  # whatever way it went, every server now holds v in full: an anchor
            self.patcher.repoint(stream)
            self.patcher.anchor()
            self.chain = self.anchor_version = version
            if verdict is not None and not verdict.get("ok", False):
                self.disk_anchor = version  # it went through the filesystem
        return stats

    def _patch(self, version: int, stream: WeightStream, *, wait_s: float) -> SyncStats:
        """weights.delta: every rank diffs its shards; rank 0 merges the ranks' parts into one patch,
        announces it (patch.json: the descriptor the orchestrator hands every server's loader) and
        broadcasts it on SGLang's group; a refusal anywhere sends v through the filesystem. Every
        ``delta_full_every`` versions v is also written to run_dir/weights as an anchor (what a fresh or
        respawned server boots from); the servers themselves stay on patches."""
        t1 = time.perf_counter()
        self.patcher.repoint(stream)
        parts, sums, changed, compared = self.patcher.diff()
        gathered = self.peers.all_gather_object(parts) if self.peers.world_size > 1 else [parts]
        nbytes, verdict = 0, None
        if self.peers.rank == 0:
            merged: dict = {}
            for p in gathered:
                for n, plist in p.items():
                    merged.setdefault(n, []).extend(plist)
            raw, mlen = patch_payload(merged, sums, self.patcher.tracker.numels, self.patcher.dtypes)
            payload = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.device)
            desc = {"format": "slurmrl-delta/1", "version": version, "anchor": self.anchor_version,
                    "group_name": self.cfg.group_name, "payload_bytes": len(raw), "manifest_bytes": mlen,
                    "checksum": buffer_checksum(payload), "verdict_dir": str(self.handshake.dir / VERDICTS_DIR),
                    "shapes": descriptor_shapes(merged, self.shapes)}
            self.handshake.write_marker(PATCH_FILE, {"version": version, "entry": descriptor_tensor(desc)})
            work = dist.broadcast(payload, src=0, group=self.sender.pg, async_op=True)
            self.sender._finish((f"patch v{version}", [work], payload))
            nbytes = len(raw)
            self._wait(lambda: (self.handshake.read_marker(VERDICT_FILE) or {}).get("version") == version,
                       f"verdict on patch v{version}")
            verdict = self.handshake.read_marker(VERDICT_FILE)
        if self.peers.world_size > 1:
            verdict = self.peers.all_gather_object(verdict)[0]
        self.last_patch = (changed, compared)
        stats = SyncStats(bytes=nbytes, seconds=time.perf_counter() - t1, wait_s=wait_s)
        self.chain = version
        if not verdict.get("ok", False):
            log.warning("patch v%d: SGLang servers refused it (%s); publishing v%d through the filesystem",
                        version, verdict.get("why", "?"), version)
            stats = self.initial.publish(version, stream)
            self.anchor_version = self.disk_anchor = version  # the servers load it whole: digests start anew
        elif version - self.disk_anchor >= self.cfg.delta_full_every:  # an anchor for recovery, on disk only
            self.initial.publish(version, stream)
            self.disk_anchor = version
        return stats

    def _wait(self, ready, what: str) -> bool:
        """Poll ``ready()`` until the deadline; False when the orchestrator finished instead."""
        deadline = time.monotonic() + self.cfg.broadcast_timeout_s
        while not ready():
            if self.paths.orchestrator_done.exists():
                return False
            if time.monotonic() > deadline:
                raise PeerTimeout(f"trainer rank {self.peers.rank}: no {what} from the orchestrator within "
                                  f"{self.cfg.broadcast_timeout_s:.0f}s ({self.handshake.dir}); see its log")
            time.sleep(0.005)
        return True

    def _form(self, stream: WeightStream) -> None:
        """Rank 0 writes group.json and joins as rank 0 (blocks until every server rank joined)."""
        cfg = self.cfg
        metas = self._metas(stream)
        backend = cfg.backend if cfg.backend != "auto" else backend_for(self.device)
        pg = None
        if self.peers.rank == 0:
            port = self.port or free_port(self.host)
            world = 1 + self.num_receivers
            self.handshake.write_group({
                "master_address": self.host, "master_port": port, "world_size": world, "num_senders": 1,
                "group_name": cfg.group_name, "backend": backend, "protocol": "sglang",
                "load_format": cfg.sglang_format, "bucket_bytes": cfg.bucket_size_mb << 20, **metas_json(metas)})
            pg = open_update_group(backend=backend, master_address=self.host, master_port=port, world_size=world,
                                   rank=0, group_name=cfg.group_name, timeout_s=cfg.broadcast_timeout_s)
        self.sender = SGLangSender(pg, plan_batches(metas, cfg.bucket_size_mb << 20), load_format=cfg.sglang_format,
                                   device=self.device, timeout_s=cfg.broadcast_timeout_s)
        if cfg.delta:  # the snapshot starts as step 0, which every server boots from (collective)
            self.patcher = PatchSender(stream, self.peers)
            self.patcher.anchor()
            self.shapes = {m.name: list(m.shape) for m in metas}
        if self.peers.world_size > 1:
            self.peers.all_gather_object(None)  # every rank leaves formation together

    def close(self) -> None:
        if self.sender is not None and self.sender.pg is not None:
            close_update_group(self.sender.pg)
            self.sender.pg = None
        self.initial.close()
