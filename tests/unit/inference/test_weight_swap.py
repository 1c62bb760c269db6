"""Staged weight updates in the embedded engine (workers/inference/embedded/weight_swap.py, issue 45 item 1).

An update is read, verified and staged while the engine decodes on the weights it has, then swapped in
between two steps. Checks: a staged chain of patches gives the weights, sums and version that applying
each version in turn gives, bit for bit; decode steps complete while an update is being loaded and while
one is staged, on the old version, with the parameters untouched until the swap; a chain that fails
verification while staged changes nothing; the worker's startup load and its routes use one receiver.
"""
from __future__ import annotations

import threading

import pytest
import torch

from workers.common.config import WeightsConfig
from workers.inference.embedded.engine import GenRequest, InferenceEngine
from workers.inference.embedded.weight_routes import WeightRoutes
from workers.models.tiny_moe.model import TinyMoeConfig, build_model
from workers.weights.base import SoloPeers, WeightLoadError
from workers.weights.delta.apply import apply_parts, stage_chain
from workers.weights.filesystem.patch_publisher import PatchPublisher
from workers.weights.filesystem.publisher import FilesystemPublisher
from workers.weights.filesystem.receiver import FilesystemReceiver
from workers.weights.stream import DictStream

CFG = TinyMoeConfig(vocab_size=16, hidden_size=32, num_layers=2, num_heads=2, num_experts=4, top_k=2,
                    expert_intermediate_size=32, max_position_embeddings=64)
torch.set_num_threads(1)


def _steps(root, n: int) -> list[dict[str, torch.Tensor]]:
    """Publish step 0 (an anchor) and n patch steps of a drifting float32 state; returns every version."""
    master = {k: v.clone() for k, v in build_model(CFG, seed=5).state_dict().items()}
    pub = PatchPublisher(FilesystemPublisher(root, peers=SoloPeers(), keep_last=20), full_every=50, publish_async=False)
    versions = []
    g = torch.Generator().manual_seed(7)
    for v in range(n + 1):
        if v:
            for name, t in master.items():
                if "norm" not in name:  # frozen tensors: in no patch
                    mask = torch.rand(t.shape, generator=g) < 0.2  # a sparse change, as a small lr gives
                    t.add_(torch.randn(t.shape, generator=g) * 1e-3 * mask)
        pub.publish(v, DictStream(master, dtype=torch.float32))
        versions.append({k: t.clone() for k, t in master.items()})
    pub.close()
    return versions


def _bits(state) -> dict[str, bytes]:
    return {n: t.detach().contiguous().view(torch.uint8).numpy().tobytes() for n, t in state.items()}


def _req(rid: str, n: int = 6) -> GenRequest:
    return GenRequest(rid=rid, input_ids=[1, 2, 3], max_new_tokens=n, temperature=0.0)


@pytest.mark.parametrize("packed", [False, True], ids=["per_storage_copies", "packed_copies"])
def test_a_staged_chain_is_bit_identical_to_applying_each_version_in_turn(tmp_path, monkeypatch, packed):
    import workers.weights.delta.apply as apply_mod

    monkeypatch.setattr(apply_mod, "PACK_ON_CPU", packed)  # packed: a GPU's one copy per dtype, split into views
    versions = _steps(tmp_path, 3)
    engine = InferenceEngine(build_model(CFG, seed=1), max_batch_size=2, seed=0)
    engine.update_weights_from_disk(str(tmp_path / "step_000000"), 0)
    held_sums = dict(engine.weight_sums)
    got = FilesystemReceiver().load(str(tmp_path / "step_000003"), expected=engine.model.state_dict(), known={},
                                    sums=held_sums)
    assert len(got.patches) == 3  # the worker holds v0: v1, v2 and v3 are applied in order

    in_turn = {k: t.clone() for k, t in engine.model.state_dict().items()}
    by_storage = build_model(CFG, seed=1).state_dict()  # the same layout (expert views of stacks) for the reference
    for k, t in in_turn.items():
        by_storage[k].copy_(t)
    sums = held_sums
    for parts, expected, where in got.patches:  # the reference: one version at a time, written as it goes
        sums = apply_parts(by_storage, parts, sums, expected, where=where)

    assert engine.update_weights_from_disk(str(tmp_path / "step_000003"), 3) == 0
    assert engine.weight_version == 3 and engine.weight_sums == sums
    timing = engine.update_timing  # where the update went, answered by the route (the timeline's engine_* phases)
    assert list(timing) == ["read_s", "stage_s", "lock_wait_s", "swap_s", "total_s"]
    assert all(v >= 0 for v in timing.values())
    assert timing["total_s"] >= timing["read_s"] + timing["stage_s"] + timing["swap_s"]
    assert _bits(engine.model.state_dict()) == _bits(by_storage) == _bits(versions[3])
    assert engine.weights_digest() == got.digest  # the transport's word for patch steps


def test_decoding_goes_on_while_an_update_loads_and_while_it_is_staged(tmp_path):
    versions = _steps(tmp_path, 1)
    engine = InferenceEngine(build_model(CFG, seed=1), max_batch_size=2, seed=0)
    engine.update_weights_from_disk(str(tmp_path / "step_000000"), 0)
    entered, release = threading.Event(), threading.Event()

    class GatedReceiver(FilesystemReceiver):
        """The real reader, held inside ``load`` until the test has decoded."""

        def load(self, *args, **kwargs):
            entered.set()
            assert release.wait(30)
            return super().load(*args, **kwargs)

    engine.use_receiver(GatedReceiver())
    engine.start()
    try:
        before = _bits(engine.model.state_dict())
        result: dict = {}
        loader = threading.Thread(target=lambda: result.setdefault(
            "n", engine.update_weights_from_disk(str(tmp_path / "step_000001"), 1)))
        loader.start()
        assert entered.wait(30)
        steps = engine.num_steps
        out = engine.generate([_req("during-load")], timeout_s=30)[0]  # the update is in progress
        assert engine.num_steps > steps and out.token_versions == [0] * 6
        assert _bits(engine.model.state_dict()) == before and engine.weight_version == 0
        release.set()
        loader.join(30)
        assert not loader.is_alive() and engine.weight_version == 1
        assert _bits(engine.model.state_dict()) == _bits(versions[1])

        # staged, not yet swapped: decode steps run on the old weights and version
        engine.use_receiver(FilesystemReceiver())
        got = engine.receiver.load(str(tmp_path / "step_000000"), expected=engine.model.state_dict(),
                                   known=engine.weight_hashes, sums=engine.weight_sums)
        with engine._update_lock:
            staged = engine.stage(got)
            out = engine.generate([_req("while-staged")], timeout_s=30)[0]
            assert out.token_versions == [1] * 6 and _bits(engine.model.state_dict()) == _bits(versions[1])
            engine.swap(staged, 2, source="rollback to step 0's weights")
        assert engine.weight_version == 2 and _bits(engine.model.state_dict()) == _bits(versions[0])
        assert engine.generate([_req("after")], timeout_s=30)[0].token_versions == [2] * 6
    finally:
        release.set()
        engine.shutdown()


def test_a_chain_that_fails_verification_while_staged_changes_nothing(tmp_path):
    _steps(tmp_path, 2)
    engine = InferenceEngine(build_model(CFG, seed=1), max_batch_size=2, seed=0)
    engine.update_weights_from_disk(str(tmp_path / "step_000000"), 0)
    before = _bits(engine.model.state_dict())
    got = engine.receiver.load(str(tmp_path / "step_000002"), expected=engine.model.state_dict(), known={},
                               sums=engine.weight_sums)
    parts, expected, where = got.patches[-1]
    name = next(n for n, ps in parts.items() if ps)
    got.patches[-1] = (parts, {**expected, name: expected[name] ^ 1}, where)  # v2's digest of one tensor is off
    with pytest.raises(WeightLoadError, match="does not match the trainer's digest"):
        stage_chain(engine.model.state_dict(), got.patches, got.sums)
    with pytest.raises(WeightLoadError, match="does not match the trainer's digest"):
        engine.apply_received(got, 2, source=where)
    assert _bits(engine.model.state_dict()) == before and engine.weight_version == 0
    assert engine.weight_sums == {}  # the next update goes through the anchor


def test_the_startup_load_and_the_routes_share_one_receiver(tmp_path):
    _steps(tmp_path, 0)
    engine = InferenceEngine(build_model(CFG, seed=1), max_batch_size=2, seed=0)
    weights = WeightsConfig()
    made = []
    engine.receiver_for(weights, lambda: made.append(FilesystemReceiver()) or made[-1])  # what startup.py does
    engine.update_weights_from_disk(str(tmp_path / "step_000000"), 0)
    routes = WeightRoutes(engine, weights)
    assert len(made) == 1 and routes.receiver is made[0] is engine.receiver
