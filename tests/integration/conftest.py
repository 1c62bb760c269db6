"""Shared by integration tests, by topic in tests/helpers/: the CLI as a local run (local_runs), an
embedded inference server process or in-process app (servers), trainer ranks on a hand-made run
directory (trainer_ranks); re-exported for ``from tests.integration.conftest import ...``.
"""
from __future__ import annotations

from tests.helpers.local_runs import SMALL, assert_no_children_left, metrics, slurmrl  # noqa: F401
from tests.helpers.servers import INIT_SEED, SERVER_MODEL, TOKEN, start_server, with_embedded_app  # noqa: F401
from tests.helpers.trainer_ranks import (RANKS_MODEL, make_batch, publish_batch, start_rank,  # noqa: F401
                                         wait_all, write_ranks_run)
