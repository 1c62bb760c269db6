"""One logger per role with a ``role[rank]`` prefix; rank 0 logs INFO, others WARNING.

Progress goes here as one line per step; numbers for plots go to metrics.jsonl instead.

Step numbers are 1-based everywhere: step N is the N-th optimizer update; metrics.jsonl
``step``, TensorBoard's and wandb's global step, ``rollouts/step_N`` (its batch),
``weights/step_N`` (the weights it publishes), ``checkpoints/step_N`` (the state after it), the
ledger, the trainer log and the console all say ``step 4`` for the same step.
``weights/step_0`` is the initial policy, before any update: no step has number 0.
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
    """``step   4/10``: the 1-based step (as in metrics.jsonl) out of how many the run trains."""
    return f"step {step:>3}" + (f"/{num_steps}" if num_steps else "")
