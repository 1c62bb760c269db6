"""Per-rank pull of a patch step (weights.transport=filesystem into SGLang: sglang/patch_pull.py + the loader's pull_patch).

The trainer side is the real PatchPublisher writing patch steps to disk; the SGLang ranks are the FusedMoE
layouts of test_sglang_delta_loader.py (EP=2, an EPLB copy). Each rank must read only the entries of the
tensors it holds (counted at os.pread, the only way the pull reads tensor data, and reported in its verdict), equal to
the sum of those tensors' parts on disk and less than the whole patch, and end bit-identical to SGLang's
layout of a dense load of the same weights. A corrupt entry, a step that is not what the descriptor says
and a rank that does not hold the base are refused with nothing changed.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.unit.weights.test_sglang_delta_loader import (E, FakeSGLangModel, bits_equal, copies, hf_state, load_dense,
                                                         sglang_layout)
from workers.common.protocol import step_name
from workers.weights.base import SoloPeers
from workers.weights.sglang.patch_loader import DESCRIPTOR, load_patch, pull_patch
from workers.weights.filesystem.patch_publisher import PatchPublisher
from workers.weights.filesystem.publisher import FilesystemPublisher
from workers.weights.stream import DictStream

EXPERT = "model.layers.0.mlp.experts."


def publisher(root: Path) -> PatchPublisher:
    return PatchPublisher(FilesystemPublisher(root, peers=SoloPeers(), keep_last=10), full_every=100,
                          publish_async=False)


def train(master, step, lr=3e-3):
    g = torch.Generator().manual_seed(step)
    for t in master.values():
        t.add_(torch.randn(t.shape, generator=g) * lr)


def part_bytes(p: dict, dtype_size: int = 2) -> int:
    """On-disk bytes of one part's entries, from index.json alone (values + int32 positions or bitmap)."""
    coded = (p["hi"] - p["lo"] + 7) // 8 if p["encoding"] == "bitmap" else 4 * p["count"]
    return coded + dtype_size * p["count"]


def holds(name: str, ep_rank: int, ep: int = 2, extra=()) -> bool:
    if not name.startswith(EXPERT):
        return True
    e = int(name[len(EXPERT):].split(".")[0])
    return ep_rank * (E // ep) <= e < (ep_rank + 1) * (E // ep) or e in extra


def descriptor(root: Path, v: int, verdicts: Path, base: int | None = None) -> dict:
    index = json.loads((root / step_name(v) / "index.json").read_text())
    return {"format": "slurmrl-delta/1", "version": v, "base": index["base"] if base is None else base,
            "anchor": index["anchor"], "step_dir": str(root / step_name(v)), "verdict_dir": str(verdicts)}


def call(model, desc: dict, verdicts: Path) -> dict:
    blob = torch.frombuffer(bytearray(json.dumps(desc).encode()), dtype=torch.uint8)
    for f in verdicts.glob(f"v{desc['version']}.*.json"):
        f.unlink()
    load_patch(model, [(DESCRIPTOR, blob)])
    (f,) = list(verdicts.glob(f"v{desc['version']}.*.json"))
    return json.loads(f.read_text())


@pytest.fixture
def preads(monkeypatch):
    """Bytes the process reads with os.pread (the pull reads tensor data with nothing else)."""
    seen = []
    real = os.pread

    def counting(fd, n, offset):
        out = real(fd, n, offset)
        seen.append(len(out))
        return out
    monkeypatch.setattr(os, "pread", counting)
    return seen


def test_each_ep_rank_reads_only_its_share_and_ends_bit_identical_to_a_dense_load(tmp_path, preads):
    root, verdicts = tmp_path / "weights", tmp_path / "verdicts"
    master = hf_state(3)
    pub = publisher(root)
    pub.publish(0, DictStream(master, dtype=torch.bfloat16))
    ranks = [FakeSGLangModel(r, 2) for r in range(2)]
    for m in ranks:
        load_dense(m, master)
    for v in (1, 2, 3):
        train(master, v)
        pub.publish(v, DictStream(master, dtype=torch.bfloat16))
        index = json.loads((root / step_name(v) / "index.json").read_text())
        whole = sum(part_bytes(p) for m in index["tensors"].values() for p in m["parts"])
        patch = root / step_name(v) / "patch-00001-of-00001.safetensors"
        head = 8 + int.from_bytes(patch.read_bytes()[:8], "little")
        assert os.path.getsize(patch) == head + whole  # part_bytes counts every data byte of the file
        for r, model in enumerate(ranks):
            share = sum(part_bytes(p) for n, m in index["tensors"].items() if holds(n, r) for p in m["parts"])
            preads.clear()
            got = call(model, descriptor(root, v, verdicts), verdicts)
            assert got["ok"], got
            assert got["bytes_read"] == share < whole, (v, r, got["bytes_read"], share, whole)
            assert sum(preads) == share, (sum(preads), share)  # tensor data: the held entries, nothing else
            assert bits_equal(model, sglang_layout(model, master)), (v, r)
    pub.close()


def test_an_eplb_copy_is_pulled_once_and_copied_to_its_replica(tmp_path):
    root = tmp_path / "weights"
    master = hf_state(4)
    pub = publisher(root)
    pub.publish(0, DictStream(master, dtype=torch.bfloat16))
    model = FakeSGLangModel(1, 2, redundant={4: 1})  # rank 1 holds experts 2, 3 and a copy of expert 1
    load_dense(model, master)
    train(master, 1)
    pub.publish(1, DictStream(master, dtype=torch.bfloat16))
    index = json.loads((root / step_name(1) / "index.json").read_text())
    with torch.no_grad():
        changed, nread = pull_patch(model, descriptor(root, 1, tmp_path), copies=copies)
    share = sum(part_bytes(p) for n, m in index["tensors"].items() if holds(n, 1, extra=(1,)) for p in m["parts"])
    assert changed > 0 and nread == share
    assert bits_equal(model, sglang_layout(model, master))
    pub.close()


def test_refusals_change_nothing_and_say_why(tmp_path):
    root, verdicts = tmp_path / "weights", tmp_path / "verdicts"
    master = hf_state(5)
    pub = publisher(root)
    pub.publish(0, DictStream(master, dtype=torch.bfloat16))
    model = FakeSGLangModel(0, 2)
    load_dense(model, master)
    train(master, 1)
    pub.publish(1, DictStream(master, dtype=torch.bfloat16))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    got = call(model, descriptor(root, 1, verdicts, base=7), verdicts)  # not the step the orchestrator meant
    assert not got["ok"] and "announced v1 on v7" in got["message"] and bits_equal(model, before)

    patch = root / step_name(1) / "patch-00001-of-00001.safetensors"
    raw = bytearray(patch.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    key = json.loads((root / step_name(1) / "index.json").read_text())["tensors"]["lm_head.weight"]["parts"][0]["key"]
    at = 8 + n + json.loads(raw[8:8 + n])[f"{key}::val"]["data_offsets"][0]
    raw[at] ^= 0xFF  # a value of a tensor this rank holds
    patch.write_bytes(bytes(raw))
    got = call(model, descriptor(root, 1, verdicts), verdicts)
    assert not got["ok"] and "checksum" in got["message"] and bits_equal(model, before), got
    raw[at] ^= 0xFF
    patch.write_bytes(bytes(raw))

    with torch.no_grad():  # the rank no longer holds the base: the digest check refuses, rolls back
        model.lm_head.weight[0, :4] += 1
    drifted = {n: p.detach().clone() for n, p in model.named_parameters()}
    got = call(model, descriptor(root, 1, verdicts), verdicts)
    assert not got["ok"] and "did not hold the patch's base" in got["message"], got
    assert bits_equal(model, drifted)
    pub.close()


def test_parts_spread_over_several_trainer_ranks_files_are_read_from_each(tmp_path, preads):
    """A tensor sharded over two trainer ranks has a part in each rank's file; a rank reads both parts, and
    nothing of the tensors it does not hold, whichever file they are in."""
    from workers.weights.delta.patch import Part, encode
    from workers.weights.sglang.patch_pull import read_held_parts

    step = tmp_path / "step"
    step.mkdir()
    g = torch.Generator().manual_seed(9)
    vals = {n: torch.randn(6, generator=g).to(torch.bfloat16) for n in ("held", "other")}
    parts = {0: {"held": [Part(torch.tensor([0, 3, 5, 7, 8, 9]), vals["held"])]},
             1: {"held": [Part(torch.tensor([60, 61, 62, 63, 64, 65]), vals["other"])],
                 "other": [Part(torch.tensor([1, 2, 3, 4, 5, 6]), vals["other"].clone())]}}
    index = {"tensors": {n: {"shape": [8, 16], "dtype": "bfloat16", "parts": []} for n in ("held", "other")}}
    for rank, ps in parts.items():
        blob, manifest = encode(ps, {"held": 128, "other": 128})
        (step / f"patch-{rank + 1:05d}-of-00002.safetensors").write_bytes(blob)
        for n, entries in manifest.items():
            index["tensors"][n]["parts"] += [{**e, "file": f"patch-{rank + 1:05d}-of-00002.safetensors"} for e in entries]
    got, nread = read_held_parts(step, index, ["held"])
    assert set(got) == {"held"} and len(got["held"]) == 2
    assert [p.positions.tolist() for p in got["held"]] == [[0, 3, 5, 7, 8, 9], [60, 61, 62, 63, 64, 65]]
    assert all(torch.equal(a.values.view(torch.int16), b.view(torch.int16))
               for a, b in zip(got["held"], (vals["held"], vals["other"])))
    share = sum(part_bytes(p) for p in index["tensors"]["held"]["parts"])
    assert nread == sum(preads) == share < share + sum(part_bytes(p) for p in index["tensors"]["other"]["parts"])
