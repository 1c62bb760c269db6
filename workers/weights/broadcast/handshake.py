"""Marker files of the broadcast transport: how trainer and orchestrator agree on an update.

No torch here: the orchestrator imports this module. Files live in
``run_dir/weights/broadcast/`` and are replaced atomically (write temp, rename), so a
reader sees an old or a new value, never half of one; ``cat`` shows where a run stands.

  ``group.json``   trainer rank 0, once: where the group's TCPStore listens and what it
                   carries: {master_address, master_port, world_size, num_senders,
                   group_name, backend, names, dtypes, shapes} (the last three: SGLang's
                   fields of /update_weights_from_distributed, in the senders' order).
  ``offer.json``   trainer rank 0, after each optimizer step: {"version": V, "digest", "delta"},
                   weights V are in the trainer's memory and it waits to send them
                   (digest: workers/weights/digest.state_digest of them with weights.verify,
                   else null).
  ``request.json`` orchestrator, after pausing every worker: {"version": V, "mode"}, the workers
                   are being told to receive V; trainer ranks start sending.
  ``reform.json``  orchestrator, when dead workers answer again: {"generation": G}; the
                   senders (waiting for a request) drop their group and form generation G
                   with every server, rank 0 rewriting ``group.json`` with {"generation": G}
                   and the group name :func:`group_name_of` (fresh keys on the same store).
  ``run_dir/DONE`` (the orchestrator's end marker) releases a trainer waiting for a request.
  ``samples.json`` / ``verdict.json``  SGLang servers only (sglang/broadcast_publisher.py): what the
                   trainer sent of the sampled tensors, and the orchestrator's read-back verdict.

:func:`workers.weights.coordinator.receiver_rank_counts` says how many group ranks each inference server
contributes (SGLang: one per TP rank, ``rank = rank_offset + tp_rank``), in ``inference_urls`` order.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

BROADCAST_DIR = "broadcast"
GROUP_FILE, OFFER_FILE, REQUEST_FILE, REFORM_FILE = "group.json", "offer.json", "request.json", "reform.json"


def group_name_of(base: str, generation: int) -> str:
    """The group's name in generation G (``weights.group_name`` itself for the first)."""
    return base if generation == 0 else f"{base}.g{generation}"


class Handshake:
    """The marker files above, for one run directory."""

    def __init__(self, run_dir: str | os.PathLike):
        self.dir = Path(run_dir) / "weights" / BROADCAST_DIR

    def reset(self) -> None:
        """Trainer rank 0 before forming a group: no marker of an earlier attempt survives."""
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _write(self, name: str, obj: Any) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{name}.tmp"
        tmp.write_text(json.dumps(obj))
        os.replace(tmp, self.dir / name)

    def _read(self, name: str) -> Optional[dict]:
        try:
            return json.loads((self.dir / name).read_text())
        except (OSError, ValueError):
            return None

    def write_marker(self, name: str, obj: Any) -> None:
        """Another marker file of this directory (SGLang's protocol: samples.json, verdict.json)."""
        self._write(name, obj)

    def read_marker(self, name: str) -> Optional[dict]:
        return self._read(name)

    def write_group(self, info: dict) -> None:
        self._write(GROUP_FILE, info)

    def read_group(self) -> Optional[dict]:
        return self._read(GROUP_FILE)

    def offer(self, version: int, digest: Optional[str] = None, *, delta: bool = False) -> None:
        self._write(OFFER_FILE, {"version": int(version), "digest": digest, "delta": bool(delta)})

    def offered(self) -> Optional[dict]:
        """{"version", "digest", "delta"} (digest: the whole-model state_digest, or None; delta: the
        trainer can send this version as a patch on the previous one), or None."""
        return self._read(OFFER_FILE)

    def request(self, version: int, mode: str = "full") -> None:
        """``mode``: ``full`` (buckets of every tensor) or ``delta`` (a patch; only when offered)."""
        self._write(REQUEST_FILE, {"version": int(version), "mode": mode})

    def requested(self) -> Optional[int]:
        got = self._read(REQUEST_FILE)
        return None if got is None else int(got["version"])

    def requested_mode(self) -> str:
        got = self._read(REQUEST_FILE) or {}
        return got.get("mode", "full")

    def reform(self, generation: int) -> None:
        self._write(REFORM_FILE, {"generation": int(generation)})

    def reform_requested(self) -> int:
        """The generation the orchestrator asked for (0: none asked)."""
        got = self._read(REFORM_FILE)
        return 0 if got is None else int(got["generation"])

    def group_of(self, generation: int) -> Optional[dict]:
        """group.json once trainer rank 0 wrote it for ``generation``, else None."""
        got = self.read_group()
        return got if got is not None and int(got.get("generation", 0)) == generation else None


def rank_offsets(counts: list[int], num_senders: int) -> list[int]:
    """First group rank of each server: the senders are ranks 0..num_senders-1."""
    out, nxt = [], num_senders
    for c in counts:
        out.append(nxt)
        nxt += c
    return out
