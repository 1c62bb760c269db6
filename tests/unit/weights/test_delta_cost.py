"""The plan's and the simulator's cost of a sparse update (workers/weights/sglang/patch_cost.py)."""
from __future__ import annotations

import pytest

from workers.weights.sglang.patch_cost import ModelSplit, ServerLayout, delta_update_cost, rank_elements
from workers.weights.delta import patch_bytes_per_element


def test_rank_shares_count_eplb_copies_and_everything_else_whole():
    split = ModelSplit(trained=1000.0, routed=800.0, num_experts=8)
    assert rank_elements(split, ServerLayout(count=1, tp=4, ep=4)) == 200 + 200
    assert rank_elements(split, ServerLayout(count=1, tp=4, ep=4, redundant_experts=4)) == 300 + 200
    assert rank_elements(split, ServerLayout(count=1, tp=2)) == 1000  # no EP: every expert on every rank
    assert rank_elements(ModelSplit(trained=10.0, routed=0.0, num_experts=0), ServerLayout(count=1, tp=8, ep=8)) == 10


def test_whole_patch_and_per_rank_seconds():
    split = ModelSplit(trained=1e12, routed=0.9e12, num_experts=64)
    lay = [ServerLayout(count=2, tp=8, ep=8)]
    c = delta_update_cost(split, lay, item_bytes=2, fraction=0.01, nic_gb_s=50, senders=16, efficiency=1.0)
    per_el = patch_bytes_per_element(0.01, 2)
    assert per_el == pytest.approx(0.06)  # sparse: 1 % x (4-byte index + 2-byte value)
    assert c.whole_bytes_per_gpu == pytest.approx(1e12 * per_el) and c.whole_s == pytest.approx(1e12 * per_el / 50e9)
    rank = (0.9e12 / 8 + 0.1e12) * per_el
    assert c.rank_bytes_per_gpu == pytest.approx(rank) and c.rank_total_bytes == pytest.approx(16 * rank)
    assert c.rank_s == pytest.approx(rank / 50e9)  # 16 receivers, 16 senders: receive-bound
    few = delta_update_cost(split, lay, item_bytes=2, fraction=0.01, nic_gb_s=50, senders=2, efficiency=1.0)
    assert few.rank_s == pytest.approx(16 * rank / (2 * 50e9))  # 2 senders push everything: send-bound
    dense_like = delta_update_cost(split, lay, item_bytes=2, fraction=1.0, nic_gb_s=50, senders=16)
    assert dense_like.bytes_per_element == pytest.approx(2 + 1 / 8)  # never worse than dense + its bitmap
