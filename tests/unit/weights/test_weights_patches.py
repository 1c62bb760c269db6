"""Filesystem transport with sparse patches (weights.delta): anchors, patch steps, every kind of receiver.

A receiver holding the base applies one patch in place; one holding an older version of the chain
catches up; a fresh or respawned one (or one that refused a patch) loads the anchor and every patch
after it. Each ends bit-identical to a dense publish of the same weights; anything it cannot apply is
refused with the old weights kept.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from workers.common.protocol import step_name
from workers.weights.base import SoloPeers, WeightLoadError
from workers.weights.delta.apply import apply_chain
from workers.weights.filesystem.layout import INDEX, index_digest
from workers.weights.filesystem.patch_publisher import PatchPublisher
from workers.weights.filesystem.publisher import FilesystemPublisher
from workers.weights.filesystem.receiver import DiskReader
from workers.weights.filesystem.resolve import resolve
from workers.weights.checksums import state_hashes
from workers.weights.digest import state_digest
from workers.weights.stream import DictStream


def _master(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"emb.weight": torch.randn(96, 16, generator=g), "layer.weight": torch.randn(16, 16, generator=g),
            "norm.weight": torch.ones(16)}


def _train(master, step, lr=2e-3):
    g = torch.Generator().manual_seed(100 + step)
    for n, t in master.items():
        if n != "norm.weight":  # a frozen tensor: never in any patch
            t.add_(torch.randn(t.shape, generator=g) * lr)


def _publisher(root: Path, **kw) -> PatchPublisher:
    full = FilesystemPublisher(root, peers=SoloPeers(), keep_last=kw.pop("keep_last", 3))
    return PatchPublisher(full, full_every=kw.pop("full_every", 4), **kw)


class Receiver:
    """What an engine keeps: tensors in its dtype, and the sums the reader hands back."""

    def __init__(self, master, dtype=torch.bfloat16):
        self.params = {n: torch.zeros(t.shape, dtype=dtype) for n, t in master.items()}
        self.sums = None
        self.reader = DiskReader()

    def load(self, step_dir: Path):
        got = self.reader.load(step_dir, self.params, None, self.sums)
        sums = apply_chain(self.params, got.patches, got.sums or {}) if got.patches else got.sums
        for n, t in got.state.items():
            self.params[n].copy_(t)
        self.sums = sums
        return got


def _same(receiver, master):
    return all(torch.equal(receiver.params[n].to(torch.bfloat16).view(torch.int16),
                           t.to(torch.bfloat16).view(torch.int16)) for n, t in master.items())


@pytest.mark.parametrize("publish_async", [True, False])
def test_patch_steps_reach_every_kind_of_receiver_bit_identical(tmp_path, publish_async):
    master = _master()
    pub = _publisher(tmp_path, publish_async=publish_async, keep_last=20)
    steady, fp32 = Receiver(master), Receiver(master, torch.float32)
    stats = []
    try:
        for v in range(0, 10):
            if v:
                _train(master, v)
            stats.append(pub.publish(v, DictStream(master, dtype=torch.bfloat16)).metrics())
            pub.flush()
            step = tmp_path / step_name(v)
            got = steady.load(step)
            fp32.load(step)
            assert _same(steady, master) and _same(fp32, master), v
            if v % 4:  # patch steps: the steady receiver applied only this version's patch, in place
                assert got.patches and len(got.patches) == 1 and not got.state
                assert json.loads((step / INDEX).read_text())["base"] == v - 1
            fresh = Receiver(master)  # a respawned worker: anchor + every patch after it
            fresh.load(step)
            assert _same(fresh, master)
            assert state_digest({n: f"{s:016x}" for n, s in fresh.sums.items()}) == index_digest(step) or v % 4 == 0
    finally:
        pub.close()
    patch = [s for s in stats[1:] if not s["weight_anchor"]]
    assert all(0 < s["weight_changed_frac"] < 1 for s in patch)
    for v in range(1, 10):
        st = json.loads((tmp_path / step_name(v) / INDEX).read_text()).get("stats")
        assert st is None or 0 < st["bytes"] < st["dense_bytes"], (v, st)  # anchors have none
    assert stats[-1]["weight_published_version"] == (8 if publish_async else 9) and stats[-1]["weight_publish_total_s"] > 0
    lagging = Receiver(master)  # holds v5 (anchor 4 + patch 5), catches up to 7 with two patches
    lagging.load(tmp_path / step_name(5))
    got = lagging.load(tmp_path / step_name(7))
    assert [Path(w).name for _, _, w in got.patches] == [step_name(6), step_name(7)]


def test_a_patch_step_resolves_into_a_full_directory(tmp_path):
    master = _master()
    pub = _publisher(tmp_path / "w", publish_async=False)
    for v in range(3):
        if v:
            _train(master, v)
        pub.publish(v, DictStream(master, dtype=torch.bfloat16))
    pub.close()
    (tmp_path / "w" / step_name(0) / "config.json").write_text("{}")  # the anchor's HF config
    out = resolve(tmp_path / "w" / step_name(2), tmp_path / "full")
    assert (out / "config.json").is_file()
    state = load_file(out / "model.safetensors")
    assert state_hashes(state) == state_hashes({n: t.to(torch.bfloat16) for n, t in master.items()})


def test_refusals_keep_the_old_weights(tmp_path):
    master = _master()
    pub = _publisher(tmp_path, publish_async=False, keep_last=10)
    r = Receiver(master)
    for v in range(3):
        if v:
            _train(master, v)
        pub.publish(v, DictStream(master, dtype=torch.bfloat16))
        if v < 2:
            r.load(tmp_path / step_name(v))
    pub.close()
    before = {n: t.clone() for n, t in r.params.items()}
    step2 = tmp_path / step_name(2)
    patch = next(step2.glob("patch-*.safetensors"))
    good = patch.read_bytes()
    patch.write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(WeightLoadError, match="unreadable patch|checksum"):
        r.load(step2)
    patch.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))  # one flipped byte
    with pytest.raises(WeightLoadError, match="checksum"):
        r.load(step2)
    patch.write_bytes(good)
    r.sums = {n: s ^ 1 for n, s in r.sums.items()}  # the receiver does not hold what it thinks
    r.load(step2)  # no step matches its sums: it goes back to the anchor and replays (a fallback, not a mix)
    assert _same(r, master)
    (tmp_path / step_name(1) / "STABLE").unlink()  # a chain with a hole
    with pytest.raises(WeightLoadError, match="no STABLE"):
        Receiver(master).load(step2)
    index = json.loads((step2 / INDEX).read_text())
    index["base"] = 7  # a base in its own future
    (step2 / INDEX).write_text(json.dumps(index))
    with pytest.raises(WeightLoadError, match="malformed"):
        Receiver(master).load(step2)
    assert all(torch.equal(before[n], before[n]) for n in before)


def test_a_worker_that_does_not_hold_the_base_refuses_in_place_and_keeps_every_value(tmp_path):
    """Stacked experts (per-expert views of one stack): a tampered receiver claims the base's sums; the
    in-place patch then fails its digest, every stack is put back, and a fresh load falls back to the anchor."""
    from workers.models.tiny_moe.model import TinyMoeConfig, build_model

    cfg = TinyMoeConfig(vocab_size=16, hidden_size=32, num_layers=2, num_heads=2, num_experts=4, top_k=2,
                        expert_intermediate_size=32, max_position_embeddings=64)
    trainer = build_model(cfg, seed=3)
    pub = _publisher(tmp_path, publish_async=False, keep_last=10)
    worker = build_model(cfg, seed=9)  # the engine's model: state_dict() gives per-expert views of its stacks
    params = worker.state_dict()
    reader, sums = DiskReader(), None
    for v in range(3):
        if v:
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(torch.randn_like(p) * 1e-2)
        pub.publish(v, DictStream(trainer.state_dict(), dtype=torch.bfloat16))
        if v < 2:
            got = reader.load(tmp_path / step_name(v), params, None, sums)
            sums = apply_chain(params, got.patches, got.sums) if got.patches else got.sums
            with torch.no_grad():
                for n, t in got.state.items():
                    params[n].copy_(t)
    pub.close()
    expert = next(n for n in params if ".experts." in n)
    with torch.no_grad():
        params[expert].view(-1)[0] += 1.0  # the worker no longer holds v1, though its sums say so
    before = {n: t.clone() for n, t in worker.named_parameters()}
    got = reader.load(tmp_path / step_name(2), params, None, sums)
    assert got.patches  # its sums match v1: it tries the in-place path
    with pytest.raises(WeightLoadError, match="does not match the trainer's digest"):
        apply_chain(params, got.patches, got.sums)
    assert all(torch.equal(t, before[n]) for n, t in worker.named_parameters()), "a refused patch left a mix"
    fresh = reader.load(tmp_path / step_name(2), params, None, None)  # what the orchestrator's retry gets
    assert not fresh.patches and fresh.state
    with torch.no_grad():
        for n, t in fresh.state.items():
            params[n].copy_(t)
    want = {n: t.to(torch.bfloat16) for n, t in trainer.state_dict().items()}
    assert all(torch.equal(params[n].to(torch.bfloat16), want[n]) for n in want)
