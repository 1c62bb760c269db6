"""Shared by every test tier. The helpers live by topic in tests/helpers/ (configs: compose, plan,
plan_error; nccl_tables; envs: EchoEnv); they are re-exported here because tests import them as
``from tests.conftest import ...`` (tests is a package).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.configs import CONF_DIR, GLM5, REPO, TINY_SLURM, compose, plan, plan_error  # noqa: F401
from tests.helpers.envs import EchoEnv  # noqa: F401
from tests.helpers.nccl_tables import ALL_REDUCE, BANNER, HEADER  # noqa: F401

TESTS = Path(__file__).resolve().parent
TIER_MARKERS = {"integration": "slow", "slurm": "slurm", "gpu": "gpu"}
"""Tier folder -> marker every test in it carries: integration tests start whole runs or servers as
local processes (``slow``), slurm tests need the local cluster, gpu tests a CUDA GPU. ``make
test-fast`` deselects all three (``-m "not slurm and not slow and not gpu"``); a unit or models test
that starts a run or a server marks itself ``slow``."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = Path(str(item.fspath)).resolve().relative_to(TESTS).parts
        marker = TIER_MARKERS.get(parts[0]) if len(parts) > 1 else None
        if marker and marker not in {m.name for m in item.iter_markers()}:
            item.add_marker(getattr(pytest.mark, marker))
