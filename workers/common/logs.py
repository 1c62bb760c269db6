"""One logger per role with a ``role[rank]`` prefix; rank 0 logs INFO, others WARNING.

Progress goes here as one line per step; numbers for plots go to metrics.jsonl instead.

Step numbers are 0-based everywhere: metrics.jsonl ``step``, ``rollouts/step_N``, the ledger,
the trainer log and the console all say ``step 3`` for the same step; :func:`step_label` adds
the 1-based count of steps done for people ("step   3 (4/4)": the fourth and last of four).
"""
from __future__ import annotations

import logging
import sys


def get_logger(role: str, rank: int = 0, *, all_ranks: bool = False) -> logging.Logger:
    """The role's logger; module loggers of the role's library code (``logging.getLogger("slurmrl.<role>")``,
    made before the rank is known) print through the same handler from then on."""
    logger = logging.getLogger(f"slurmrl.{role}.{rank}")
    level = logging.INFO if (rank == 0 or all_ranks) else logging.WARNING
    for lg in (logger, logging.getLogger(f"slurmrl.{role}")):
        if not lg.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter(f"%(asctime)s {role}[{rank}] %(levelname)s %(message)s", "%H:%M:%S"))
            lg.addHandler(handler)
            lg.propagate = False
        lg.setLevel(level)
    return logger


def step_label(step: int, num_steps: int | None = None) -> str:
    """``step 3 (4/10)``: the 0-based step id (as in metrics.jsonl) and how many steps are done."""
    return f"step {step:>3}" + (f" ({step + 1}/{num_steps})" if num_steps else "")
