"""Shared by unit tests: rendering sbatch scripts for golden files (tests/helpers/rendering.py) and
the dry-run CLI (tests/helpers/cli.py), re-exported for ``from tests.unit.conftest import ...``."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.netutil import free_port, gloo_dims

from tests.helpers.cli import slurmrl  # noqa: F401
from tests.helpers.rendering import GOLDEN, PATHS, render, sbatch_blocks, srun_steps  # noqa: F401


@pytest.fixture(scope="module")
def dims():
    """A one-rank gloo process group (the trainer's ParallelDims at world 1), one intra-op thread."""
    torch.set_num_threads(1)
    d = gloo_dims(0, 1, free_port())
    yield d
    d.destroy()
