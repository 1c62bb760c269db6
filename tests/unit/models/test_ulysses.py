"""The pure part of Ulysses context parallelism (workers/models/blocks/ulysses.py): repeating shared
groups (GQA kv heads, Mamba-2 B/C groups) so that cp splits them, without changing which group a
head reads. The all-to-alls themselves run in tests/integration/test_context_parallel.py."""
from __future__ import annotations

import math

import pytest
import torch

from workers.models.blocks.ulysses import spread_groups


@pytest.mark.parametrize("groups,heads,cp", [(2, 4, 2), (2, 4, 4), (1, 8, 4), (3, 12, 4), (4, 8, 8), (8, 8, 2)])
def test_spread_groups_splits_evenly_and_keeps_each_heads_group(groups, heads, cp):
    x = torch.arange(groups)[None, :, None].float()  # [1, groups, 1]: each group holds its own index
    spread, n = spread_groups(x, groups, heads, cp, dim=1)
    assert n == spread.shape[1] == math.lcm(groups, cp)  # split evenly, never more copies than that needs
    per = heads // n  # heads per spread group
    for rank in range(cp):  # rank r holds heads [r*H/cp, ...) and spread groups [r*n/cp, ...)
        for j in range(heads // cp):
            h = rank * heads // cp + j
            local_group = rank * n // cp + j // per
            assert spread[0, local_group, 0] == h // (heads // groups), (rank, h)
    if groups % cp == 0:
        assert spread is x, "nothing is copied when cp divides the groups"
