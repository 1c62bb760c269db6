"""The ``damaged_patches`` test transport's trainer side (tests/plugins/damaged_weights_plugin.py)."""
from __future__ import annotations

import json
import time
from pathlib import Path

from workers.weights.base import peers_for
from workers.weights.filesystem.layout import INDEX
from workers.weights.filesystem.patch_publisher import PatchPublisher
from workers.weights.filesystem.publisher import filesystem_publisher


class DamagingPublisher(PatchPublisher):
    """A PatchPublisher whose rank 0 damages chosen patch steps in their temp dir, before the rename."""

    def __init__(self, full, *, kinds: list[str], gap: int, log_file: Path, **kw):
        super().__init__(full, **kw)
        self.kinds, self.gap, self.log_file = list(kinds), gap, log_file
        self.last_damaged = self.num_damaged = 0

    def _place(self, tmp: Path, final: Path) -> None:
        version = int(final.name[5:])
        answered = self.reanchors >= self.num_damaged  # the last damage was answered by an anchor out of turn
        if self.kinds and answered and version >= self.last_damaged + self.gap and self._damage(tmp, self.kinds[0]):
            with open(self.log_file, "a") as f:
                f.write(json.dumps({"version": version, "kind": self.kinds.pop(0), "time": time.time()}) + "\n")
            self.last_damaged, self.num_damaged = version, self.num_damaged + 1
        super()._place(tmp, final)

    @staticmethod
    def _damage(tmp: Path, kind: str) -> bool:
        """Damage the step in ``tmp``; False when this step cannot take ``kind`` (no patch file, base == anchor)."""
        index = json.loads((tmp / INDEX).read_text())
        files = sorted(tmp.glob("patch-*.safetensors"))
        if kind in ("flip", "truncate", "delete") and not files:
            return False
        if kind == "flip":
            blob = bytearray(files[0].read_bytes())
            blob[-1] ^= 0xFF
            files[0].write_bytes(bytes(blob))
        elif kind == "truncate":
            blob = files[0].read_bytes()
            files[0].write_bytes(blob[: len(blob) // 2])
        elif kind == "delete":
            files[0].unlink()
        elif kind == "index":
            (tmp / INDEX).write_bytes(b"\x00not json{" + bytes(range(256)))
        elif kind == "base":
            if index["base"] <= index["anchor"]:
                return False
            (tmp / INDEX).write_text(json.dumps({**index, "base": index["base"] - 1}))
        return True


def make_publisher(cfg, paths, topology, *, rank: int, world_size: int, device=None) -> DamagingPublisher:
    w = cfg.weights
    full = filesystem_publisher(w, paths, peers_for(rank, world_size), model=cfg.model)
    return DamagingPublisher(full, kinds=[k for k in w.damage.split(",") if k], gap=w.damage_gap,
                             log_file=paths.root / "weights_damaged.jsonl", full_every=w.delta_full_every,
                             snapshot=w.delta_snapshot, publish_async=w.publish_async)
