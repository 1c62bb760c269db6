"""One logger per role with a ``role[rank]`` prefix; rank 0 logs INFO, others WARNING.

Progress goes here as one line per step; numbers for plots go to metrics.jsonl instead.
"""
from __future__ import annotations

import logging
import sys


def get_logger(role: str, rank: int = 0, *, all_ranks: bool = False) -> logging.Logger:
    logger = logging.getLogger(f"slurmrl.{role}.{rank}")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"%(asctime)s {role}[{rank}] %(levelname)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.INFO if (rank == 0 or all_ranks) else logging.WARNING)
    return logger
