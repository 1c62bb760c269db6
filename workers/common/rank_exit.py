"""How a spawned rank process ends: without interpreter teardown (every multi-process tool and role uses it).

Two-process gloo runs aborted at exit now and then ("terminate called without an active exception",
SIGABRT): a process group (and its TCPStore) still alive when the interpreter tore down, after a peer
rank had exited first; a thread still running kept a rank from exiting at all. :func:`exit_rank`
destroys what is left of the process groups, flushes and leaves with ``os._exit``.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Callable


def exit_rank(code: int = 0) -> None:
    """End a rank process without interpreter teardown: destroy what is left of its process groups,
    flush, ``os._exit``. Why: a gloo group (and its TCPStore) still alive when the interpreter exits
    aborted the process ("terminate called without an active exception", SIGABRT) whenever a peer
    rank had exited first, and a thread still running kept it from exiting at all; torch's C++
    objects are never torn down by a clean exit here, so neither can happen."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # a peer gone already: the process ends below either way
        pass
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def rank_entry(rank: int, worker: Callable, *args) -> None:
    """Process entry for every spawned rank (``mp.start_processes(rank_entry, args=(worker, ...))``
    or ``Process(target=rank_entry, args=(rank, worker, ...))``): ``worker(rank, *args)``, then
    :func:`exit_rank`. An exception propagates as before (torch records it for the parent)."""
    worker(rank, *args)
    exit_rank(0)


