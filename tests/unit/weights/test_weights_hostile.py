"""Hostile weights on the filesystem transport (issue 22): non-finite tensors, malformed step
directories and files that are not regular files. Real files, real publisher and reader.

- The publisher refuses NaN/inf (found in the hashing pass) on every rank together, naming
  the tensor and the step, and leaves no step behind; ``weights.skip_nonfinite`` skips instead.
- The reader refuses NaN/inf even under a valid checksum, every malformed index.json or shard
  header with WeightLoadError (the HTTP route's 400), and FIFOs, symlinks and paths outside
  the weights root before opening them (a FIFO must never block).
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from workers.models.tiny_moe.model import TinyMoeConfig, build_model
from workers.weights.base import NonFiniteWeights, StorePeers, WeightLoadError
from workers.weights.checksums import nonfinite_names, tensor_hash
from workers.weights.filesystem.layout import INDEX
from workers.weights.filesystem.publisher import FilesystemPublisher, publish_step
from workers.weights.filesystem.receiver import load_step

torch.set_num_threads(1)
CFG = TinyMoeConfig(vocab_size=16, hidden_size=32, num_layers=2, num_heads=2, num_experts=4, top_k=2,
                    expert_intermediate_size=32, max_position_embeddings=64)


def state(seed: int = 3) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in build_model(CFG, seed=seed).state_dict().items()}


def publish_ranks(root: Path, version: int, st, world: int, **kw) -> tuple[list, list]:
    """Every rank publishes in its own thread: (per-rank SyncStats or None, per-rank exception or None)."""
    store = dist.HashStore()
    pubs = [FilesystemPublisher(root, peers=StorePeers(store, r, world, prefix="pub"), keep_last=3, **kw)
            for r in range(world)]
    out, errors = [None] * world, [None] * world

    def run(r):
        try:
            out[r] = pubs[r].publish(version, st)
        except BaseException as e:
            errors[r] = e
    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for p in pubs:
        p.close()
    return out, errors


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_rank_refuses_a_nonfinite_step_naming_tensor_and_step(tmp_path, value, dtype):
    st = {k: v.to(dtype) for k, v in state().items()}
    name = sorted(st)[-1]
    st[name].view(-1)[st[name].numel() // 2] = value
    out, errors = publish_ranks(tmp_path, 4, st, world=2)
    assert all(isinstance(e, NonFiniteWeights) for e in errors), errors
    assert all(f"weights step 4 not published: tensor {name} holds NaN or inf" in str(e) for e in errors)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no step, no temp dir


def test_skip_nonfinite_skips_the_step_and_the_next_finite_one_publishes(tmp_path):
    bad = state()
    bad["lm_head.weight"][0, 0] = float("nan")
    out, errors = publish_ranks(tmp_path, 1, bad, world=2, skip_nonfinite=True)
    assert errors == [None, None] and all(o.skipped for o in out)
    assert not (tmp_path / "step_000001").exists()
    out, errors = publish_ranks(tmp_path, 2, state(), world=2, skip_nonfinite=True)
    assert errors == [None, None] and not any(o.skipped for o in out)
    assert set(load_step(tmp_path / "step_000002")) == set(bad)


def test_delta_publish_checks_the_tensors_it_writes(tmp_path):
    pub = FilesystemPublisher(tmp_path, peers=StorePeers(dist.HashStore(), 0, 1, prefix="p"), keep_last=5,
                              delta=True, full_every=10)
    try:
        st = state()
        pub.publish(0, st)
        st["lm_head.weight"][1, 1] = float("inf")
        with pytest.raises(NonFiniteWeights, match="step 1 .* tensor lm_head.weight"):
            pub.publish(1, st)
    finally:
        pub.close()


def write_nan_with_valid_checksum(step: Path, name: str) -> None:
    """Rewrite one tensor's bytes on disk to hold a NaN and fix its index.json hash (a bad
    publisher, or a trainer that skipped our check): only the finiteness check can refuse it."""
    from workers.weights.shards import read_header
    index = json.loads((step / INDEX).read_text())
    shard = step / index["weight_map"][name]
    header, start = read_header(shard)
    begin, end = header[name]["data_offsets"]
    raw = bytearray(shard.read_bytes())
    raw[start + begin: start + begin + 4] = torch.tensor([float("nan")]).view(torch.uint8).numpy().tobytes()
    shard.write_bytes(bytes(raw))
    t = torch.frombuffer(bytearray(raw[start + begin: start + end]), dtype=torch.float32)
    index["tensors"][name]["xxh3"] = tensor_hash(t)
    (step / INDEX).write_text(json.dumps(index))


def test_reader_refuses_nan_even_under_a_valid_checksum(tmp_path):
    publish_step(tmp_path, 1, state(), keep_last=3)
    write_nan_with_valid_checksum(tmp_path / "step_000001", "model.embed_tokens.weight")
    with pytest.raises(WeightLoadError, match="tensor model.embed_tokens.weight .* holds NaN or inf"):
        load_step(tmp_path / "step_000001")


def test_nonfinite_names_checks_floats_only():
    t = {"a": torch.ones(3), "b": torch.tensor([1.0, float("nan")]), "i": torch.arange(3)}
    assert nonfinite_names(t.items()) == ["b"]
    f8 = torch.tensor([1.0, float("inf")]).to(torch.float8_e5m2)
    assert nonfinite_names([("f8", f8)]) == ["f8"]


def _edit_index(fn):
    def damage(step: Path):
        index = json.loads((step / INDEX).read_text())
        fn(index)
        (step / INDEX).write_text(json.dumps(index))
    return damage


def _first(index):
    return sorted(index["tensors"])[0]


MALFORMED = {
    "index_list": lambda s: (s / INDEX).write_text("[1, 2]"),
    "index_deep": lambda s: (s / INDEX).write_text("[" * 100_000 + "]" * 100_000),
    "index_binary": lambda s: (s / INDEX).write_bytes(b"\xff\xfe\x00garbage"),
    "index_dir": lambda s: ((s / INDEX).unlink(), (s / INDEX).mkdir()),
    "tensors_list": _edit_index(lambda i: i.__setitem__("tensors", [])),
    "shape_strings": _edit_index(lambda i: i["tensors"][_first(i)].__setitem__("shape", ["a", "b"])),
    "shape_negative": _edit_index(lambda i: i["tensors"][_first(i)].__setitem__("shape", [-1, 4])),
    "dtype_unknown": _edit_index(lambda i: i["tensors"][_first(i)].__setitem__("dtype", "float128")),
    "hash_missing": _edit_index(lambda i: i["tensors"][_first(i)].pop("xxh3")),
    "map_int": _edit_index(lambda i: i["weight_map"].__setitem__(_first(i), 5)),
    "map_absolute": _edit_index(lambda i: i["weight_map"].__setitem__(_first(i), "/etc/passwd")),
    "map_outside": _edit_index(lambda i: i["weight_map"].__setitem__(_first(i), "../../../../../../dev/zero")),
    "map_nul": _edit_index(lambda i: i["weight_map"].__setitem__(_first(i), "model\0.safetensors")),
    "header_offsets": lambda s: _rewrite_header(s, lambda h: h[_tensor(h)].__setitem__("data_offsets", ["x", 1])),
    "header_size": lambda s: _rewrite_header(s, lambda h: h[_tensor(h)].__setitem__("data_offsets", [0, 4])),
    "header_not_object": lambda s: _rewrite_header(s, None),
}


def _tensor(header: dict) -> str:
    return [k for k in sorted(header) if k != "__metadata__"][0]


def _rewrite_header(step: Path, fn) -> None:
    shard = step / "model.safetensors"
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8: 8 + n])
    if fn is None:
        new = b"[1]" + b" " * (n - 3)
    else:
        fn(header)
        new = json.dumps(header, separators=(",", ":")).encode()
        new += b" " * (n - len(new))
    assert len(new) == n
    shard.write_bytes(raw[:8] + new + raw[8 + n:])


@pytest.mark.parametrize("damage", sorted(MALFORMED))
def test_malformed_steps_are_refused_with_weight_load_error(tmp_path, damage):
    publish_step(tmp_path / "weights", 1, state(), keep_last=3)
    step = tmp_path / "weights" / "step_000001"
    MALFORMED[damage](step)
    with pytest.raises(WeightLoadError):
        load_step(step, expected=build_model(CFG, seed=0).state_dict())


@pytest.mark.parametrize("kind", ["fifo", "symlink_inside", "symlink_dev", "index_fifo"])
def test_non_regular_files_are_refused_before_opening(tmp_path, kind):
    publish_step(tmp_path, 1, state(), keep_last=3)
    step = tmp_path / "step_000001"
    shard = step / "model.safetensors"
    if kind == "fifo":
        shard.unlink()
        os.mkfifo(shard)
    elif kind == "symlink_inside":
        shard.rename(step / "real.safetensors")
        shard.symlink_to(step / "real.safetensors")
    elif kind == "symlink_dev":
        shard.unlink()
        shard.symlink_to("/dev/zero")
    else:
        (step / INDEX).unlink()
        os.mkfifo(step / INDEX)
    t0 = time.monotonic()
    with pytest.raises(WeightLoadError, match="symlink|not a regular file") as e:
        load_step(step)
    assert time.monotonic() - t0 < 5, "a FIFO must never block the reader"
    assert str(step) in str(e.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_huge_finite_weights_whose_sum_overflows_are_still_published_and_read(tmp_path, dtype):
    st = {k: v.to(dtype) for k, v in state().items()}
    st["lm_head.weight"].fill_(3e38)  # the chunk sum overflows to inf: the exact check must clear it
    publish_step(tmp_path, 1, st, keep_last=3)
    assert torch.equal(load_step(tmp_path / "step_000001")["lm_head.weight"], st["lm_head.weight"])


def test_nonfinite_screen_checks_a_healthy_model_in_one_pass_and_an_overflowing_sum_is_not_nan(monkeypatch):
    """Every publish checks for NaN/inf: a healthy model costs one screen (not two kernels a tensor);
    finite tensors whose sums overflow fall back to the exact check and are still finite."""
    calls = []
    real = torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda t: calls.append(t.shape) or real(t))
    healthy = {f"w{i}": torch.randn(64) for i in range(30)}
    assert nonfinite_names(healthy.items()) == [] and len(calls) == 1, calls
    calls.clear()
    huge = {**healthy, "big": torch.full((8,), 3e38)}  # sum of magnitudes overflows float32
    assert nonfinite_names(huge.items()) == [] and len(calls) == 1 + 31
    huge["w7"][3] = float("nan")
    assert nonfinite_names(huge.items()) == ["w7"]
