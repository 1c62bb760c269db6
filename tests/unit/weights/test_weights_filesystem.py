"""Filesystem weight transport: sharded parallel publish, refusals that keep the old weights,
delta steps and the retention that must keep what they point at.

Trainer "ranks" are threads sharing a HashStore (StorePeers): the same publish code as the
real run, where the gather goes over the trainer's gloo group instead.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from workers.inference.embedded.engine import GenRequest, InferenceEngine
from workers.models.tiny_moe.model import TinyMoeConfig, build_model
from workers.weights.base import SoloPeers, StorePeers, WeightLoadError, assign_shares, TensorMeta
from workers.weights.checksums import state_hashes
from workers.weights.filesystem.layout import INDEX, index_digest
from workers.weights.filesystem.publisher import FilesystemPublisher, prune, publish_step
from workers.weights.filesystem.receiver import DiskReader, load_step
from workers.weights.digest import state_digest

torch.set_num_threads(1)
CFG = TinyMoeConfig(vocab_size=16, hidden_size=32, num_layers=2, num_heads=2, num_experts=4, top_k=2,
                    expert_intermediate_size=32, max_position_embeddings=64)


def model_state(seed: int = 3) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in build_model(CFG, seed=seed).state_dict().items()}


def mixed_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(300, 40, generator=g), "norm.weight": torch.randn(40, generator=g),
            "head.weight": torch.randn(17, 40, generator=g).to(torch.bfloat16), "step": torch.tensor(7),
            "mask": torch.tensor([True, False, True]), "empty": torch.zeros(0, 4)}


def publish_with_ranks(root: Path, version: int, state, world: int, store=None, pubs=None, **kw):
    """Every rank publishes in its own thread; returns the per-rank SyncStats."""
    store = store or dist.HashStore()
    pubs = pubs or [FilesystemPublisher(root, peers=StorePeers(store, r, world, prefix="pub"), keep_last=kw.pop(
        "keep_last", 3), **kw) for r in range(world)]
    out, errors = [None] * world, []

    def run(r):
        try:
            out[r] = pubs[r].publish(version, state)
        except BaseException as e:
            errors.append(e)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    pubs[0].wait_pruned()  # retention runs in the background on rank 0
    return out, pubs, store


def test_one_rank_round_trip_is_bit_exact_and_plain_safetensors(tmp_path):
    state = mixed_state()
    out = publish_step(tmp_path, 0, state, keep_last=2)
    assert out["bytes"] == sum(t.numel() * t.element_size() for t in state.values())
    step = tmp_path / "step_000000"
    assert sorted(p.name for p in step.iterdir()) == ["STABLE", INDEX, "model.safetensors"]
    index = json.loads((step / INDEX).read_text())
    assert index["tensors"]["head.weight"] == {"shape": [17, 40], "dtype": "bfloat16",
                                               "xxh3": state_hashes(state)["head.weight"]}
    plain = load_file(str(step / "model.safetensors"))  # the reference reader accepts our writer
    assert state_hashes(plain) == state_hashes(state)
    assert state_hashes(load_step(step, expected=state)) == state_hashes(state)
    assert index_digest(step) == state_digest(state_hashes(state))


def test_two_ranks_write_disjoint_shares_in_parallel(tmp_path):
    state = model_state()
    stats, pubs, _ = publish_with_ranks(tmp_path, 1, state, world=2)
    step = tmp_path / "step_000001"
    shards = sorted(p.name for p in step.glob("*.safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    share = [set(load_file(str(step / s))) for s in shards]
    assert not share[0] & share[1] and share[0] | share[1] == set(state)
    sizes = [(step / s).stat().st_size for s in shards]
    assert max(sizes) < 0.6 * sum(sizes), sizes  # balanced by bytes
    assert stats[0].bytes == stats[1].bytes == sum(t.numel() * 4 for t in state.values())
    assert state_hashes(load_step(step, expected=state)) == state_hashes(state)
    assert not list(tmp_path.glob(".step_*"))  # the temp dir was renamed into place


def test_assign_shares_is_deterministic_and_balanced():
    metas = [TensorMeta(f"t{i}", "float32", (i + 1,), 4 * (i + 1)) for i in range(20)]
    a, b = assign_shares(metas, 3), assign_shares(list(metas), 3)
    assert a == b and sorted(m.name for s in a for m in s) == sorted(m.name for m in metas)
    loads = [sum(m.nbytes for m in s) for s in a]
    assert max(loads) - min(loads) <= 4 * 20


def corrupt(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x5A
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage, message", [
    ("corrupt", "fails its checksum"),
    ("no_stable", "has no STABLE marker"),
    ("truncate", "is truncated"),
    ("shape", "published shape"),
    ("missing_shard", "does not exist"),
    ("index", "index.json is unreadable"),
])
def test_bad_steps_are_refused_and_the_engine_keeps_serving(tmp_path, damage, message):
    model = build_model(CFG, seed=3)
    engine = InferenceEngine(model, max_batch_size=4, seed=0).start()
    try:
        prompt = GenRequest(input_ids=[1, 2, 3], temperature=0.0, max_new_tokens=6)
        before = engine.generate([prompt])[0]
        held = state_hashes(model.state_dict())
        new = {k: v * 1.5 for k, v in model.state_dict().items()}
        if damage == "shape":
            new["lm_head.weight"] = torch.randn(CFG.vocab_size + 1, CFG.hidden_size)
        publish_with_ranks(tmp_path, 1, new, world=2)
        step = tmp_path / "step_000001"
        shard = step / "model-00002-of-00002.safetensors"
        if damage == "corrupt":
            corrupt(shard, shard.stat().st_size - 5)
        elif damage == "no_stable":
            (step / "STABLE").unlink()
        elif damage == "truncate":
            shard.write_bytes(shard.read_bytes()[:-100])
        elif damage == "missing_shard":
            shard.unlink()
        elif damage == "index":
            (step / INDEX).write_text("{")
        with pytest.raises(WeightLoadError, match=message) as e:
            engine.update_weights_from_disk(str(step), 1)
        if damage in ("corrupt", "truncate", "missing_shard"):
            assert shard.name in str(e.value)  # the message names the file
        after = engine.generate([prompt])[0]
    finally:
        engine.shutdown()
    assert engine.weight_version == 0 and state_hashes(model.state_dict()) == held
    assert after.output_ids == before.output_ids and after.token_versions == [0] * 6


def test_good_update_makes_the_engine_bit_identical(tmp_path):
    model = build_model(CFG, seed=3)
    engine = InferenceEngine(model, max_batch_size=4, seed=0)
    trained = model_state(seed=11)
    publish_with_ranks(tmp_path, 4, trained, world=2)
    assert engine.update_weights_from_disk(str(tmp_path / "step_000004"), 4) == 0
    assert engine.weight_version == 4 and state_hashes(model.state_dict()) == state_hashes(trained)


def test_delta_steps_write_only_changes_and_retention_keeps_referenced_files(tmp_path):
    state = model_state()
    frozen = [n for n in state if "experts" in n]  # e.g. frozen experts: never change
    store, pubs = dist.HashStore(), None
    versions = {}
    for v in range(6):
        state = {n: (t if n in frozen else t + 0.01) for n, t in state.items()}
        versions[v] = state
        stats, pubs, store = publish_with_ranks(tmp_path, v, state, world=2, store=store, pubs=pubs, keep_last=2,
                                                delta=True, full_every=4)
        moved = sum(t.numel() * 4 for n, t in state.items() if v in (0, 4) or n not in frozen)
        assert stats[0].bytes == moved, (v, stats[0].bytes, moved)
    names = sorted(p.name for p in tmp_path.iterdir())
    # 4 and 5 are the newest two; 5 is a delta of 4 (a full step): older ones are gone.
    assert names == ["step_000004", "step_000005"], names
    weight_map = json.loads((tmp_path / "step_000005" / INDEX).read_text())["weight_map"]
    assert all(weight_map[n].startswith("../step_000004/") for n in frozen)
    assert state_hashes(load_step(tmp_path / "step_000005")) == state_hashes(versions[5])


def test_retention_keeps_an_old_full_step_while_a_kept_delta_points_at_it(tmp_path):
    state, pubs = model_state(), None
    frozen = [n for n in state if "experts" in n]
    for v in range(4):
        state = {n: (t if n in frozen else t + 0.01) for n, t in state.items()}
        _, pubs, _ = publish_with_ranks(tmp_path, v, state, world=1, pubs=pubs, keep_last=2, delta=True,
                                        full_every=100)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000", "step_000002", "step_000003"]
    assert state_hashes(load_step(tmp_path / "step_000003")) == state_hashes(state)
    (tmp_path / ".step_000001.tmp").mkdir()  # a rank died mid-publish long ago
    assert prune(tmp_path, keep_last=2, newest=3) == [".step_000001.tmp"]


def test_reader_skips_tensors_it_already_holds(tmp_path):
    state = model_state()
    pub = FilesystemPublisher(tmp_path, peers=SoloPeers(), keep_last=3, delta=True)
    pub.publish(0, state)
    changed = dict(state, **{"lm_head.weight": state["lm_head.weight"] + 1})
    pub.publish(1, changed)
    reader = DiskReader()
    first = reader.load(tmp_path / "step_000000")
    second = reader.load(tmp_path / "step_000001", known=first.hashes)
    assert list(second.state) == ["lm_head.weight"] and second.num_skipped == len(state) - 1
    assert second.bytes == changed["lm_head.weight"].numel() * 4
    assert second.hashes == state_hashes(changed)
