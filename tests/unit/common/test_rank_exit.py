"""Spawned ranks end cleanly (issue 35 item 8): two-process gloo tools died at exit with
"terminate called without an active exception" (SIGABRT). The cause, reproduced here: a process
group still alive when the interpreter exits aborts a rank whose peer exited first; a thread
still running keeps the rank from exiting at all. Every rank now ends through
``local_ranks.exit_rank`` (groups destroyed, no interpreter teardown)."""
from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from benchmarks.local_ranks import gloo_dims, run_ranks


def _leaves_its_group_and_a_thread(rank: int, world: int, port: int, delay_s: float) -> None:
    gloo_dims(rank, world, port, cp=world)
    t = torch.ones(8)
    dist.all_reduce(t)
    assert t[0] == world
    threading.Thread(target=time.sleep, args=(3600,), name="forgotten").start()  # non-daemon, never ends
    if rank == 0:
        time.sleep(delay_s)  # the peer exits first, with the group alive


def test_ranks_exit_cleanly_with_a_live_group_and_thread():
    t0 = time.monotonic()
    for _ in range(3):
        run_ranks(_leaves_its_group_and_a_thread, 2, (0.5,), what="exit test", start_method="spawn", timeout_s=90)
    assert time.monotonic() - t0 < 240
