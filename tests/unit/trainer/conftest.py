"""Shared fixtures of the trainer unit tests."""
from __future__ import annotations

import pytest
import torch

from tests.netutil import free_port, gloo_dims


@pytest.fixture(scope="module")
def dims():
    """A one-rank gloo process group (the trainer's ParallelDims at world 1), one intra-op thread."""
    torch.set_num_threads(1)
    d = gloo_dims(0, 1, free_port())
    yield d
    d.destroy()
