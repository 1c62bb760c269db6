"""Exit codes shared by the roles and the two supervisors (launcher/local_backend.py for local
runs, launcher/supervisor.py for the srun steps of a Slurm job).

A role that fails for a reason a restart would only repeat (the optimizer diverged, the run's
config cannot work on this machine) exits with :data:`EXIT_FATAL` after logging the reason;
the supervisors then stop the run at once instead of restarting the role. Any other non-zero
exit (a crash, a kill, an OOM) is restarted within the run's budget. Standard library only at
import time: the Slurm supervisor imports it on the batch node.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

EXIT_FATAL = 78
"""A deterministic failure: do not restart (the value of sysexits.h's EX_CONFIG)."""


def fatal_on_config_error(main: Callable[[], Any]) -> Any:
    """Run a role's ``main``; a config error (workers.common.config.ConfigError: a run.yaml this
    role cannot use) prints one line and exits :data:`EXIT_FATAL` instead of a traceback and a
    restart that would fail the same way."""
    from workers.common.config import ConfigError

    try:
        return main()
    except ConfigError as e:
        print(f"slurmrl: config error (not restarted): {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_FATAL)
