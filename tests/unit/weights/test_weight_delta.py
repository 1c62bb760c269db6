"""Sparse weight deltas (workers/weights/delta): detection, wire form, application, digests.

The rule every test checks in its own way: a receiver that applies the patches ends bit-identical to
what a dense publish of the same weights gives, and refuses (keeping its weights) what it cannot apply.
"""
from __future__ import annotations

import pytest
import torch

from workers.weights.base import SoloPeers, WeightLoadError
from workers.weights.delta import patch_bytes_per_element
from workers.weights.delta.apply import apply_parts
from workers.weights.delta.patch import Part, decode, encode
from workers.weights.delta.sum64 import MASK, delta_sum64, tensor_sum64
from workers.weights.delta.tracker import DeltaTracker
from workers.weights.stream import DictStream


def _ref_sum64(t: torch.Tensor) -> int:
    """sum64 with Python integers (the definition, no torch int64 wrapping)."""
    from workers.weights.delta.sum64 import weights_at

    b = t.reshape(-1).view(torch.int16).tolist()
    w = weights_at(torch.arange(len(b), dtype=torch.int64)).tolist()
    return sum(x * y for x, y in zip(b, w)) & MASK


def test_sum64_matches_its_definition_and_updates_from_a_patch_alone():
    t = torch.randn(1000, dtype=torch.bfloat16)
    assert tensor_sum64(t) == _ref_sum64(t)
    new = t.clone()
    pos = torch.tensor([3, 17, 999])
    new[pos] = torch.tensor([1.0, -2.0, 0.5], dtype=torch.bfloat16)
    assert (tensor_sum64(t) + delta_sum64(t[pos], new[pos], pos)) & MASK == tensor_sum64(new)
    flipped = t.clone()
    flipped.view(torch.int16)[500] ^= 1  # one bit of one element
    assert tensor_sum64(flipped) != tensor_sum64(t)


def _model_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 32, generator=g), "b.weight": torch.randn(4096, generator=g),
            "c.bias": torch.randn(7, generator=g)}


def _step(state: dict[str, torch.Tensor], lr: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in state.values():
        t.add_(torch.randn(t.shape, generator=g) * lr)


def test_tracker_patches_make_a_receiver_bit_identical_to_a_dense_publish():
    master = _model_state()  # fp32 "master weights"
    stream = DictStream(master, dtype=torch.bfloat16)
    tracker = DeltaTracker(stream, stream.metas, SoloPeers())
    sums = tracker.reset()
    receiver = {n: t.to(torch.bfloat16).clone() for n, t in master.items()}
    assert sums == {n: tensor_sum64(t) for n, t in receiver.items()}
    held = dict(sums)
    dtypes = {m.name: m.dtype for m in stream.metas}
    fractions = []
    for step in range(1, 8):
        _step(master, 1e-3, step)  # small steps: most bf16 values stay put
        parts, dsum, compared = tracker.diff()
        blob, manifest = encode(parts, tracker.numels)
        changed = sum(p.count for ps in parts.values() for p in ps)
        fractions.append(changed / compared)
        expected = {n: (held[n] + dsum.get(n, 0)) & MASK for n in held}
        got = decode(blob, manifest, dtypes=dtypes, where=f"v{step}")
        held = apply_parts(receiver, got, held, expected, where=f"v{step}")
        for n, t in master.items():
            assert torch.equal(receiver[n].view(torch.int16), t.to(torch.bfloat16).view(torch.int16)), (step, n)
        assert held == {n: tensor_sum64(t) for n, t in receiver.items()}
    assert 0 < max(fractions) < 0.5


def test_encoding_picks_bitmap_for_dense_changes_and_indices_for_sparse_ones():
    dense = Part(torch.arange(0, 1000, 2), torch.zeros(500, dtype=torch.bfloat16))
    sparse = Part(torch.tensor([5, 900_000]), torch.zeros(2, dtype=torch.bfloat16))
    _, m = encode({"d": [dense], "s": [sparse]}, {"d": 1000, "s": 1_000_000})
    assert m["d"][0]["encoding"] == "bitmap" and m["s"][0]["encoding"] == "sparse"
    assert patch_bytes_per_element(0.01, 2) == pytest.approx(0.06)
    assert patch_bytes_per_element(1.0, 2) == pytest.approx(2.125)


def test_a_corrupt_truncated_or_misapplied_patch_is_refused_and_nothing_changes():
    t = {"w": torch.zeros(100, dtype=torch.bfloat16)}
    part = Part(torch.tensor([1, 2, 3]), torch.ones(3, dtype=torch.bfloat16))
    blob, manifest = encode({"w": [part]}, {"w": 100})
    with pytest.raises(WeightLoadError, match="unreadable patch"):
        decode(blob[: len(blob) // 2], manifest, dtypes={"w": "bfloat16"}, where="x")
    bad = bytearray(blob)
    bad[-1] ^= 0xFF  # a flipped byte inside the values
    with pytest.raises(WeightLoadError, match="checksum"):
        decode(bytes(bad), manifest, dtypes={"w": "bfloat16"}, where="x")
    parts = decode(blob, manifest, dtypes={"w": "bfloat16"}, where="x")
    wrong_base = {"w": 12345}  # the receiver's digest is not the patch's base
    after = tensor_sum64(torch.tensor([0, 1, 1, 1] + [0] * 96, dtype=torch.bfloat16))
    with pytest.raises(WeightLoadError, match="did not hold the patch's base"):
        apply_parts(t, parts, wrong_base, {"w": after}, where="x")
    assert torch.count_nonzero(t["w"]) == 0  # rolled back
    out = apply_parts(t, parts, {"w": 0}, {"w": after}, where="x")
    assert out["w"] == after and torch.count_nonzero(t["w"]) == 3
    with pytest.raises(WeightLoadError, match="outside"):
        apply_parts(t, {"w": [Part(torch.tensor([100]), torch.ones(1, dtype=torch.bfloat16))]}, out, out, where="x")


def test_expert_views_of_one_stack_take_one_group():
    stack = torch.zeros(4, 3, 2, dtype=torch.bfloat16)
    params = {f"e{k}": stack[k] for k in range(4)}
    parts = {f"e{k}": [Part(torch.tensor([k]), torch.full((1,), float(k + 1), dtype=torch.bfloat16))] for k in range(4)}
    sums = {n: 0 for n in params}
    expected = {n: tensor_sum64(torch.zeros(6, dtype=torch.bfloat16).index_fill_(0, torch.tensor([k]), k + 1))
                for k, n in enumerate(params)}
    apply_parts(params, parts, sums, expected, where="x")
    assert [float(stack[k].reshape(-1)[k]) for k in range(4)] == [1.0, 2.0, 3.0, 4.0]


def test_tracker_diff_reads_the_host_a_fixed_number_of_times_whatever_the_number_of_tensors(monkeypatch):
    """What training waits for: on a GPU shared with inference every host read waits for the other
    process's kernels, so a diff reads the host four times in all (counts, sums, positions, values), not per tensor."""
    g = torch.Generator().manual_seed(3)
    master = {f"t{i}.weight": torch.randn(256, generator=g) for i in range(40)}
    stream = DictStream(master, dtype=torch.bfloat16)
    tracker = DeltaTracker(stream, stream.metas, SoloPeers())
    tracker.reset()
    for i in range(0, 40, 2):
        master[f"t{i}.weight"][i] += 1.0
    reads = {"tolist": 0, "nonzero": 0, "cpu": 0}
    for name in reads:
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _r=real, _n=name, **k: (
            reads.__setitem__(_n, reads[_n] + 1), _r(self, *a, **k))[1])
    monkeypatch.setattr(torch, "nonzero", lambda *a, **k: pytest.fail("a sized nonzero reads the host"))
    parts, dsum, compared = tracker.diff()
    assert reads["tolist"] == 2 and reads["nonzero"] == 0, reads  # the counts, then every sum64 change
    assert reads["cpu"] == 2, reads  # positions and values of every changed tensor, one copy each
    assert compared == 40 * 256 and sorted(parts) == sorted(f"t{i}.weight" for i in range(0, 40, 2))
    assert all(p.positions.tolist() == [int(n[1:].split(".")[0])] for n, ps in parts.items() for p in ps)
    assert set(dsum) == set(parts)
