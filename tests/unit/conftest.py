"""Shared by unit tests: rendering sbatch scripts for golden files (tests/helpers/rendering.py) and
the dry-run CLI (tests/helpers/cli.py), re-exported for ``from tests.unit.conftest import ...``."""
from __future__ import annotations

from tests.helpers.cli import slurmrl  # noqa: F401
from tests.helpers.rendering import GOLDEN, PATHS, render, sbatch_blocks, srun_steps  # noqa: F401
