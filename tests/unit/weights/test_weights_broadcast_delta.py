"""Sparse patches over the broadcast group (weights.delta, workers/weights/broadcast/delta_wire.py), on real gloo.

Senders and receivers are threads of this process, each its own group rank and backends; the test plays
the orchestrator through the marker files, choosing full or patch as BroadcastCoordinator does. The rule:
after any number of patch updates a receiver's weights are bit-identical to a dense publish of the same
weights; a receiver that does not hold a patch's base refuses it and keeps its weights, and the next
version, sent whole, brings it back.
"""
from __future__ import annotations

import time

import torch

from tests.unit.weights.test_weights_broadcast import Harness, run_threads
from workers.weights.base import WeightLoadError, expert_id
from workers.weights.stream import DictStream

torch.set_num_threads(1)


def master_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(64, 16, generator=g), "layers.0.mlp.experts.0.w1": torch.randn(32, 16, generator=g),
            "layers.0.mlp.experts.1.w1": torch.randn(32, 16, generator=g), "norm.weight": torch.randn(16, generator=g)}


def train_step(state, step, lr=3e-4):
    g = torch.Generator().manual_seed(1000 + step)
    for t in state.values():
        t.add_(torch.randn(t.shape, generator=g) * lr)


class DeltaHarness(Harness):
    """Harness with weights.delta: receivers keep their own bf16 models (what step 0 on disk gives them)."""

    def __init__(self, tmp_path, master, *, experts=(None, None), full_every=4):
        self.master, self.need_full = master, False
        self.models = [{n: t.to(torch.bfloat16).clone() for n, t in master.items()
                        if e is None or expert_id(n) in (None, *e)} for e in experts]
        super().__init__(tmp_path, self.stream(), experts=experts, delta=True, delta_full_every=full_every)

    def stream(self):
        return DictStream(self.master, dtype=torch.bfloat16)

    def update(self, version):
        """One update as the coordinator drives it; returns (mode, receiver errors)."""
        chosen = {}

        def orchestrate():
            while (offer := self.handshake.offered() or {}).get("version") != version:
                time.sleep(0.002)
            chosen["mode"] = "delta" if offer.get("delta") and not self.need_full else "full"
            self.handshake.request(version, chosen["mode"])

        def receive(i):
            while "mode" not in chosen:
                time.sleep(0.002)
            r, params = self.receivers[i], self.models[i]
            if chosen["mode"] == "delta":
                return r.receive_patch(version, lambda fn: fn(params))
            state, _, _ = r.receive(version, self.announced)
            for n, t in state.items():
                params[n].copy_(t)
        out, errors = run_threads([lambda p=p: p.publish(version, self.stream()) for p in self.pubs] + [orchestrate]
                                  + [lambda i=i: receive(i) for i in range(len(self.receivers))])
        n = len(self.pubs) + 1
        assert not any(errors[:n]), errors[:n]
        self.need_full = any(e is not None for e in errors[n:])
        return chosen["mode"], errors[n:], out[:len(self.pubs)]

    def dense(self):
        return {n: t.to(torch.bfloat16) for n, t in self.master.items()}


def same_bits(a, b):
    return all(torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a)


def test_patches_end_bit_identical_to_a_dense_publish_with_anchors_between(tmp_path):
    h = DeltaHarness(tmp_path, master_state(), experts=(None, [1]), full_every=4)
    try:
        modes = []
        for v in range(1, 10):
            train_step(h.master, v)
            mode, errors, stats = h.update(v)
            modes.append(mode)
            assert errors == [None, None], errors
            dense = h.dense()
            for model in h.models:
                assert same_bits(model, {n: dense[n] for n in model}), (v, mode)
            if mode == "delta":
                changed, compared = h.pubs[0].last_patch
                assert 0 < changed < compared  # most bf16 elements did not move
                assert stats[0].bytes < sum(t.numel() * 2 for t in dense.values())  # smaller than dense
        assert modes == ["delta", "delta", "delta", "full", "delta", "delta", "delta", "full", "delta"]
        assert set(h.models[1]) == {n for n in h.master if expert_id(n) in (None, 1)}  # holds expert 1 only
        train_step(h.master, 10, lr=0.05)  # a step that moves most elements: a patch would cost more than dense
        mode, errors, _ = h.update(10)
        assert mode == "full" and errors == [None, None] and same_bits(h.models[0], h.dense())
    finally:
        h.close()


def test_a_receiver_without_the_base_refuses_keeps_its_weights_and_the_next_version_goes_whole(tmp_path):
    h = DeltaHarness(tmp_path, master_state(1), full_every=100)
    try:
        train_step(h.master, 1)
        assert h.update(1)[0] == "delta"
        h.models[1]["embed.weight"].reshape(-1)[:64] += 1  # this worker no longer holds the base v1
        drifted = {n: t.clone() for n, t in h.models[1].items()}
        h.master["embed.weight"].reshape(-1)[:64] += 0.5  # a step that surely changes the drifted elements
        mode, errors, _ = h.update(2)
        assert mode == "delta" and errors[0] is None
        assert isinstance(errors[1], WeightLoadError) and "did not hold the patch's base" in str(errors[1])
        assert same_bits(h.models[1], drifted)  # rolled back: nothing half-applied
        assert same_bits(h.models[0], h.dense())
        train_step(h.master, 3)
        mode, errors, _ = h.update(3)  # the coordinator asks for the whole model after a refusal
        assert mode == "full" and errors == [None, None]
        assert all(same_bits(m, h.dense()) for m in h.models)
        train_step(h.master, 4)
        mode, errors, _ = h.update(4)  # and the chain resumes from that anchor
        assert mode == "delta" and errors == [None, None] and all(same_bits(m, h.dense()) for m in h.models)
    finally:
        h.close()
