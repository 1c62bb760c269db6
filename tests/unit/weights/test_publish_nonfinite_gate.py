"""The NaN/inf gate every publisher shares (base.refuse_nonfinite, broadcast/group_publisher.py):
all trainer ranks decide alike from every rank's findings, and a refused version is never offered."""
from __future__ import annotations

import pytest
import torch

from workers.weights.base import NonFiniteWeights, Peers, SoloPeers, refuse_nonfinite
from workers.weights.broadcast import BroadcastWeightsConfig
from workers.weights.broadcast.handshake import Handshake
from workers.weights.sglang.broadcast_publisher import SGLangBroadcastPublisher
from workers.common.protocol import RunPaths


class TwoRanks(Peers):
    """Rank ``rank`` of two, the other rank having found ``other``."""

    world_size = 2

    def __init__(self, rank: int, other: list[str]):
        self.rank, self.other = rank, other

    def all_gather_object(self, obj):
        return [obj, self.other] if self.rank == 0 else [self.other, obj]


def test_a_clean_rank_refuses_with_the_rank_that_found_nan():
    assert refuse_nonfinite(3, [], skip=True, peers=TwoRanks(0, ["b.weight"])) is True
    with pytest.raises(NonFiniteWeights, match=r"step 3 .*tensor a\.weight .*and 1 more"):
        refuse_nonfinite(3, ["b.weight"], skip=False, peers=TwoRanks(1, ["a.weight"]))
    assert refuse_nonfinite(3, [], skip=False, peers=TwoRanks(0, [])) is False
    assert refuse_nonfinite(3, ["x"], skip=True) is True  # already gathered: no peers


class NeverPublish:
    def publish(self, version, state):
        raise AssertionError("the first publish is not under test")

    def close(self):
        pass


@pytest.mark.parametrize("skip", [False, True])
def test_sglang_publisher_never_offers_a_nonfinite_version(tmp_path, skip):
    cfg = BroadcastWeightsConfig(skip_nonfinite=skip)
    pub = SGLangBroadcastPublisher(RunPaths(tmp_path), cfg, SoloPeers(), initial=NeverPublish(), host="127.0.0.1",
                                   port=0, num_receivers=1, inference_dtype="bfloat16")
    pub.sender = object()  # formed (the group itself is not under test)
    state = {"w": torch.tensor([1.0, float("nan")]), "b": torch.zeros(2)}
    if skip:
        assert pub.publish(1, state).skipped
    else:
        with pytest.raises(NonFiniteWeights, match="tensor w holds NaN"):
            pub.publish(1, state)
    assert Handshake(tmp_path).offered() is None  # nothing offered: no receiver waits for it
