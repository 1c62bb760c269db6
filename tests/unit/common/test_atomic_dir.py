"""workers/common/atomic_dir.py: readers see a published directory whole with its marker, or not at all.

Real files in a temp directory; ``os.fsync`` is wrapped (not replaced: the real call still runs) to
record which paths were synced, since a crash cannot be simulated in-process.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from workers.common.atomic_dir import publish_dir, seal, temp_dir


@pytest.fixture
def synced(monkeypatch):
    """The paths os.fsync was called on, in order (resolved from each fd via /proc/self/fd)."""
    calls: list[Path] = []
    real = os.fsync

    def record(fd):
        calls.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        return real(fd)

    monkeypatch.setattr(os, "fsync", record)
    return calls


def test_publish_syncs_files_marker_dir_and_parent_before_and_after_the_rename(tmp_path, synced):
    final = tmp_path / "steps" / "step_000003"
    final.parent.mkdir()

    def write(tmp: Path) -> None:
        (tmp / "a.bin").write_bytes(b"x" * 10)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.bin").write_bytes(b"y")

    publish_dir(final, write, "STABLE")
    assert (final / "a.bin").read_bytes() == b"x" * 10 and (final / "sub" / "b.bin").read_bytes() == b"y"
    assert "time" in json.loads((final / "STABLE").read_text())
    assert not (final.parent / ".step_000003.tmp").exists()
    tmp = final.parent / ".step_000003.tmp"
    names = [str(p) for p in synced]
    for p in (tmp / "a.bin", tmp / "sub" / "b.bin", tmp / "sub", tmp / "STABLE", tmp):
        assert str(p) in names, f"{p} never fsync'd: {names}"
    assert names[-1] == str(final.parent), "the parent must be fsync'd last (it makes the rename durable)"
    assert names.index(str(tmp / "STABLE")) > names.index(str(tmp / "a.bin")), "marker synced before the payload"


def test_a_crash_before_the_rename_leaves_no_visible_step(tmp_path):
    final = tmp_path / "step_000001"

    def write(tmp: Path) -> None:
        (tmp / "a.bin").write_bytes(b"partial")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        publish_dir(final, write, "STABLE")
    assert not final.exists() and [p.name for p in tmp_path.iterdir()] == [".step_000001.tmp"]
    publish_dir(final, lambda tmp: (tmp / "b.bin").write_bytes(b"whole"), "STABLE")  # the next try starts afresh
    assert sorted(p.name for p in final.iterdir()) == ["STABLE", "b.bin"]


def test_seal_replaces_an_older_final_unless_told_to_keep_it(tmp_path):
    final = tmp_path / "step_000002"
    publish_dir(final, lambda tmp: (tmp / "old").write_text("1"), "COMPLETE")
    tmp = temp_dir(final, fresh=True)
    (tmp / "new").write_text("2")
    with pytest.raises(OSError):  # another writer published it first: keep theirs
        seal(tmp, final, "COMPLETE", {"step": 2}, replace=False)
    assert (final / "old").exists()
    seal(tmp, final, "COMPLETE", {"step": 2})
    assert sorted(p.name for p in final.iterdir()) == ["COMPLETE", "new"]
    assert json.loads((final / "COMPLETE").read_text())["step"] == 2
