"""The orchestrator's view of a patch chain (sglang/pull_coordinator.patch_chain): which steps a server pulls.

Real steps from the real PatchPublisher: a patch step's chain runs back by base pointers to its anchor; a full
step has none; a pruned or unstable step anywhere on the chain is an error naming it (the server would
otherwise be handed a descriptor it cannot apply, or skip a version).
"""
from __future__ import annotations

import shutil

import pytest
import torch

from workers.common.protocol import STABLE, step_name
from workers.weights.base import SoloPeers
from workers.weights.coordinator import WeightUpdateError
from workers.weights.filesystem.patch_publisher import PatchPublisher
from workers.weights.filesystem.publisher import FilesystemPublisher
from workers.weights.sglang.pull_coordinator import patch_chain
from workers.weights.stream import DictStream


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "weights"
    pub = PatchPublisher(FilesystemPublisher(root, peers=SoloPeers(), keep_last=10), full_every=3, publish_async=False)
    g = torch.Generator().manual_seed(0)
    master = {"a.weight": torch.randn(32, 8, generator=g), "b.weight": torch.randn(8, generator=g)}
    for v in range(5):
        master["a.weight"][v] += 0.5
        pub.publish(v, DictStream(master, dtype=torch.bfloat16))
    pub.close()
    return root


def test_a_patch_step_runs_back_to_its_anchor_and_a_full_step_has_no_chain(root):
    assert patch_chain(root, 2) == (0, [1, 2])
    assert patch_chain(root, 3) == (3, [])  # an anchor (every 3 versions)
    assert patch_chain(root, 4) == (3, [4])


def test_a_missing_or_unstable_step_on_the_chain_is_named(root):
    shutil.rmtree(root / step_name(0))
    with pytest.raises(WeightUpdateError, match="anchor weights step 0 of step 2"):
        patch_chain(root, 2)
    shutil.rmtree(root / step_name(1))
    with pytest.raises(WeightUpdateError, match=r"weights step 1 \(on the chain of 2\) is gone"):
        patch_chain(root, 2)
    (root / step_name(4) / STABLE).unlink()
    with pytest.raises(WeightUpdateError, match="weights step 4 is gone"):
        patch_chain(root, 4)
