"""Broadcast weight transport over real gloo groups: senders and receivers are threads of
this process (each its own group rank and backends), the orchestrator's part is played by
the test through the same marker files (handshake.py).

Covers: the bucket plan, two senders (one per trainer DP shard) to a full receiver and to
one holding a subset of the experts, bit-exactness, and refusals (corrupt bucket, wrong
version, announced metadata that disagrees) after which the group still works.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from workers.weights.broadcast import BroadcastWeightsConfig
from workers.common.protocol import RunPaths
from workers.models.tiny_moe.model import TinyMoeConfig, build_model
from workers.weights.base import NonFiniteWeights, StorePeers, TensorMeta, WeightLoadError, expert_id
from workers.weights.broadcast.publisher import BroadcastPublisher, BucketSender
from workers.weights.broadcast.receiver import BroadcastReceiver
from workers.weights.checksums import buffer_checksum, state_hashes
from workers.weights.filesystem.publisher import FilesystemPublisher
from workers.weights.broadcast.group import make_plan
from workers.weights.broadcast.handshake import Handshake

torch.set_num_threads(1)
CFG = TinyMoeConfig(vocab_size=16, hidden_size=32, num_layers=2, num_heads=2, num_experts=4, top_k=2,
                    expert_intermediate_size=32, max_position_embeddings=64)


def run_threads(fns, timeout=60):
    out, errors = [None] * len(fns), [None] * len(fns)

    def call(i):
        try:
            out[i] = fns[i]()
        except BaseException as e:
            errors[i] = e
    threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out, errors


class Harness:
    """``senders`` trainer ranks and one receiver per entry of ``experts`` (None: all experts)."""

    def __init__(self, tmp_path, state, *, senders=2, experts=(None, None), bucket_mb=1, timeout_s=20, **settings):
        self.paths = RunPaths(tmp_path).ensure()
        self.timeout_s = timeout_s
        cfg = BroadcastWeightsConfig(bucket_size_mb=bucket_mb, broadcast_timeout_s=timeout_s, verify=True, **settings)
        store = dist.HashStore()
        peers = [StorePeers(store, r, senders) for r in range(senders)]
        self.pubs = [BroadcastPublisher(self.paths, cfg, p, initial=FilesystemPublisher(
            self.paths.root / "weights", peers=p, keep_last=3), host="127.0.0.1", port=0, num_receivers=len(experts))
            for p in peers]
        self.handshake = Handshake(self.paths.root)
        self.receivers = [None] * len(experts)
        self.announced = None

        self.senders, self.experts = senders, experts
        _, errors = run_threads([lambda p=p: p.publish(0, state) for p in self.pubs]
                                + [lambda i=i, e=e: self.join(i, e) for i, e in enumerate(experts)])
        assert not any(errors), errors

    def join(self, i, held, generation=0):
        """Receiver i joins the group of ``generation`` once trainer rank 0 announced it."""
        while (g := self.handshake.group_of(generation)) is None:
            time.sleep(0.005)
        self.announced = [TensorMeta(n, d, tuple(s), 0) for n, d, s in zip(g["names"], g["dtypes"], g["shapes"])]
        self.receivers[i] = BroadcastReceiver(
            master_address=g["master_address"], master_port=g["master_port"], rank=self.senders + i,
            world_size=g["world_size"], group_name=g["group_name"], backend=g["backend"], timeout_s=self.timeout_s,
            experts=held)

    def update(self, version, state, *, expect=None, announced=None):
        """One update: senders publish, the 'orchestrator' requests, receivers receive."""
        def orchestrate():
            while (self.handshake.offered() or {}).get("version") != version:
                time.sleep(0.002)
            self.handshake.request(version)
        recv = [lambda r=r: r.receive(version if expect is None else expect, announced or self.announced)
                for r in self.receivers]
        out, errors = run_threads([lambda p=p: p.publish(version, state) for p in self.pubs] + [orchestrate] + recv)
        n = len(self.pubs) + 1
        assert not any(errors[:n]), errors[:n]  # senders never fail because a receiver refused
        return out[:len(self.pubs)], out[n:], errors[n:]

    def close(self):
        for x in self.pubs + self.receivers:
            x.close()


def bumped(state, v):
    return {n: t + v for n, t in state.items()}


def test_plan_groups_by_receiver_set_and_dtype_and_respects_the_bucket_size():
    m = lambda n, d="float32", b=400: TensorMeta(n, d, (b // 4,), b)  # noqa: E731
    manifests = {0: [m("embed.weight", b=1000), m("layers.0.mlp.experts.0.w"), m("layers.0.mlp.experts.1.w"),
                     m("norm.weight"), m("head.weight", "bfloat16")],
                 1: [m("layers.0.mlp.experts.2.w"), m("layers.0.mlp.experts.3.w")]}
    plan = make_plan(manifests, {2: None, 3: [0, 2]}, bucket_bytes=900)
    by_names = {tuple(e.name for e in b.entries): (b.sender, b.receivers, b.dtype) for b in plan}
    assert by_names == {
        ("embed.weight",): (0, (2, 3), "float32"),  # larger than a bucket: alone
        ("layers.0.mlp.experts.0.w", "norm.weight"): (0, (2, 3), "float32"),  # 400 + 400 <= 900: packed
        ("layers.0.mlp.experts.1.w",): (0, (2,), "float32"),  # rank 3 does not hold expert 1
        ("head.weight",): (0, (2, 3), "bfloat16"),
        ("layers.0.mlp.experts.2.w",): (1, (2, 3), "float32"),
        ("layers.0.mlp.experts.3.w",): (1, (2,), "float32"),
    }
    assert [b.index for b in plan] == list(range(len(plan)))
    assert plan[1].sender == 1  # senders interleave, so both send from the start


@pytest.mark.parametrize("bucket_mb", [0, 1], ids=["lone-tensors", "packed"])
def test_two_senders_reach_a_full_and_a_subset_receiver_bit_exactly(tmp_path, bucket_mb):
    state = build_model(CFG, seed=3).state_dict()
    state["lm_head.weight"] = state["lm_head.weight"].to(torch.bfloat16)  # a second dtype: its own buckets
    h = Harness(tmp_path, state, experts=(None, [0, 2]), bucket_mb=bucket_mb)
    try:
        plan = h.pubs[0].group.plan
        assert {b.sender for b in plan} == {0, 1} and {b.dtype for b in plan} == {"float32", "bfloat16"}
        assert (bucket_mb == 1) == any(len(b.entries) > 1 for b in plan)
        for v in (1, 2):
            new = bumped(state, v)
            stats, got, errors = h.update(v, new)
            assert errors == [None, None], errors
            want = state_hashes(new)
            (full, n_full, _), (part, n_part, _) = got
            assert state_hashes(full) == want
            held = {n for n in new if expert_id(n) in (None, 0, 2)}
            assert set(part) == held and all(state_hashes(part)[n] == want[n] for n in held)
            assert n_part < n_full == sum(t.numel() * t.element_size() for t in new.values())
            assert stats[0].bytes == n_full and stats[0].seconds > 0 and not stats[0].skipped
    finally:
        h.close()


class CorruptingSender(BucketSender):
    """Announces a checksum the data does not have: what a flipped bit in transit looks like."""

    def _pack(self, bucket, state, slot):
        buf, checksum = super()._pack(bucket, state, slot)
        return buf, f"{(int(checksum, 16) ^ 1):016x}"


def test_corrupt_bucket_wrong_version_and_bad_metadata_are_refused_and_the_group_survives(tmp_path):
    state = build_model(CFG, seed=3).state_dict()
    h = Harness(tmp_path, state, experts=(None,))
    try:
        good = h.pubs[1].sender
        h.pubs[1].sender = CorruptingSender(h.pubs[1].group)
        _, _, errors = h.update(1, bumped(state, 1))
        assert isinstance(errors[0], WeightLoadError) and "fails its checksum" in str(errors[0])
        assert "trainer rank 1" in str(errors[0])
        h.pubs[1].sender = good

        _, _, errors = h.update(2, bumped(state, 2), expect=7)  # the worker was told another version
        assert isinstance(errors[0], WeightLoadError) and "header says version 2" in str(errors[0])

        wrong = [TensorMeta(m.name, m.dtype, m.shape[::-1], 0) if m.name == "lm_head.weight" else m
                 for m in h.announced]
        _, _, errors = h.update(3, bumped(state, 3), announced=wrong)
        assert isinstance(errors[0], WeightLoadError) and "tensor lm_head.weight: announced" in str(errors[0])

        _, got, errors = h.update(4, bumped(state, 4))  # every refusal drained its buckets
        assert errors == [None] and state_hashes(got[0][0]) == state_hashes(bumped(state, 4))
    finally:
        h.close()


def test_senders_stop_once_the_orchestrator_is_done(tmp_path):
    state = build_model(CFG, seed=3).state_dict()
    h = Harness(tmp_path, state, senders=1, experts=(None,))
    try:
        h.paths.orchestrator_done.write_text("3")
        out = h.pubs[0].publish(1, bumped(state, 1))
        assert out.skipped and out.bytes == 0
        assert h.handshake.offered()["version"] == 1
    finally:
        h.close()


def test_nonfinite_weights_are_never_offered_and_the_group_survives(tmp_path):
    state = build_model(CFG, seed=3).state_dict()
    h = Harness(tmp_path, state, experts=(None,))
    try:
        bad = bumped(state, 1)
        bad["lm_head.weight"][0, 0] = float("nan")
        _, errors = run_threads([lambda p=p: p.publish(1, bad) for p in h.pubs])
        assert all(isinstance(e, NonFiniteWeights) and "weights step 1 not published: tensor lm_head.weight" in str(e)
                   for e in errors), errors
        assert (h.handshake.offered() or {}).get("version") != 1  # receivers never wait for it
        _, got, errors = h.update(2, bumped(state, 2))
        assert errors == [None] and state_hashes(got[0][0]) == state_hashes(bumped(state, 2))
    finally:
        h.close()


class NanSender(BucketSender):
    """Sends a NaN under a valid checksum (a sender without the publisher's check)."""

    def _pack(self, bucket, state, slot):
        buf, _ = super()._pack(bucket, state, slot)
        buf = buf.clone()
        if buf.dtype.is_floating_point:
            buf.view(-1)[0] = float("nan")
        return buf, buffer_checksum(buf)


def test_receiver_refuses_nan_under_a_valid_checksum(tmp_path):
    state = build_model(CFG, seed=3).state_dict()
    h = Harness(tmp_path, state, experts=(None,))
    try:
        good = h.pubs[0].sender
        h.pubs[0].sender = NanSender(h.pubs[0].group)
        _, _, errors = h.update(1, bumped(state, 1))
        assert isinstance(errors[0], WeightLoadError) and "holds NaN or inf" in str(errors[0])
        assert "fails its checksum" not in str(errors[0])
        h.pubs[0].sender = good
        _, got, errors = h.update(2, bumped(state, 2))
        assert errors == [None]
    finally:
        h.close()


def test_a_receiver_dying_mid_run_skips_one_version_and_the_reformed_group_delivers(tmp_path):
    """Receiver 1 dies (its backends close): the senders' next transfer fails and that version is
    skipped, not fatal; the orchestrator's reform.json makes the senders form generation 1 on
    the same store, receiver 0 and a new receiver 1 join it, and the next version is bit-exact."""
    state = build_model(CFG, seed=3).state_dict()
    h = Harness(tmp_path, state, senders=1, experts=(None, None), timeout_s=5)
    try:
        h.receivers[1].close()  # the worker process is gone

        def request(version):
            while (h.handshake.offered() or {}).get("version") != version:
                time.sleep(0.002)
            h.handshake.request(version)
        out, errors = run_threads([lambda: h.pubs[0].publish(1, bumped(state, 1)), lambda: request(1),
                                   lambda: h.receivers[0].receive(1, h.announced)])
        assert errors[0] is None and out[0].skipped and out[0].bytes == 0, (out, errors)
        assert h.pubs[0].broken_generation == 0

        h.receivers[0].close()  # the orchestrator's /destroy_weights_update_group on the live worker
        h.handshake.reform(1)
        new = bumped(state, 2)

        def rejoin_and_receive(i, held):
            h.join(i, held, generation=1)
            return h.receivers[i].receive(2, h.announced)
        out, errors = run_threads([lambda: h.pubs[0].publish(2, new), lambda: request(2)]
                                  + [lambda i=i, e=e: rejoin_and_receive(i, e) for i, e in enumerate(h.experts)])
        assert not any(errors), errors
        assert h.handshake.group_of(1)["group_name"] == "slurmrl_weights.g1" and h.pubs[0].generation == 1
        assert out[0].bytes > 0 and not out[0].skipped
        for state_got, _, _ in out[2:]:
            assert all(torch.equal(state_got[n], new[n]) for n in new)
        senders, got, errors = h.update(3, bumped(state, 3))  # and keeps working
        assert not any(errors) and senders[0].bytes > 0, errors
    finally:
        h.close()


def test_senders_pack_streamed_tensors_one_at_a_time(tmp_path):
    """The trainer hands a stream (gathered tensor by tensor on a sharded model): each sender walks
    the whole plan, copies its buckets' tensors into the send slots and drops them, so the
    tensors held at once stay ~one per sender although a 1 MiB bucket holds this whole model."""
    from tests.helpers.held_stream import Held
    from workers.weights.stream import DictStream

    state = build_model(CFG, seed=3).state_dict()
    h = Harness(tmp_path, state)
    try:
        new = Held(DictStream(bumped(state, 1)))
        stats, got, errors = h.update(1, new)
        assert errors == [None, None], errors
        assert state_hashes(got[0][0]) == state_hashes(bumped(state, 1))
        largest = max(m.nbytes for m in new.metas)
        assert new.peak <= 2 * 2 * largest and new.peak * 4 < new.nbytes, (new.peak, largest, new.nbytes)
        assert new.live == 0, "no sender keeps a streamed tensor"
    finally:
        h.close()
