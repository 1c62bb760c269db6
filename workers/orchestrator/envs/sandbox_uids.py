"""The sandbox's uid pool: every Sandbox in one process shares its uids (one uid = one run at a time), so
two programs never run as the same uid and a uid's leftover processes can be found and killed by uid
(workers/orchestrator/envs/sandbox.py). Its own module: the pool is process state, the sandbox is policy."""
from __future__ import annotations

import asyncio
import os


class UidPool:
    """Sandbox uids of this process, shared by every Sandbox in it (one uid = one run at a time).

    Spread by pid so that orchestrators on one node rarely share a uid."""

    def __init__(self, uid_base: int, num_uids: int):
        self.uids = [uid_base + (os.getpid() % 512) * num_uids + i for i in range(num_uids)]
        self.free = list(self.uids)
        self.loops: dict[int, asyncio.Condition] = {}

    def _cond(self) -> asyncio.Condition:
        loop = id(asyncio.get_running_loop())  # a Condition belongs to one event loop (tests run several)
        return self.loops.setdefault(loop, asyncio.Condition())

    async def take(self) -> int:
        cond = self._cond()
        async with cond:
            await cond.wait_for(lambda: bool(self.free))
            return self.free.pop(0)

    async def give(self, uid: int) -> None:
        cond = self._cond()
        async with cond:
            self.free.append(uid)
            cond.notify()


_pools: dict[tuple[int, int, int], UidPool] = {}


def uid_pool(uid_base: int, num_uids: int) -> UidPool:
    """The pool of (uid_base, num_uids) for this process (a forked child gets its own)."""
    key = (uid_base, num_uids, os.getpid())
    if key not in _pools:
        _pools[key] = UidPool(uid_base, num_uids)
    return _pools[key]
