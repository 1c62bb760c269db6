"""The orchestrator's side of a broadcast worker's revival (workers/weights/broadcast/coordinator.py),
with fake workers that record the admin calls and a 'trainer' played through the marker files:
no update while a member is dead; once it answers, destroy on the live ones -> reform.json ->
group.json of generation 1 -> every worker joins; the revived worker is readmitted only by the
next update. (End to end: tests/integration/test_faults_inference.py, tests/slurm/test_server_respawn.py.)"""
from __future__ import annotations

import asyncio
import logging

from tests.conftest import compose
from workers.common.inference_client import InferenceError
from workers.common.protocol import RunPaths
from workers.orchestrator.faults import WorkerPool
from workers.weights.broadcast.coordinator import BroadcastCoordinator
from workers.weights.broadcast.handshake import Handshake, group_name_of

LOG = logging.getLogger("test")


class FakeWorker:
    """The admin calls the coordinator makes, recorded; ``up`` decides whether it answers."""

    def __init__(self, url):
        self.base_url, self.up, self.calls = url, True, []

    async def _call(self, name, **kw):
        self.calls.append((name, kw.get("group_name"), kw.get("weight_version")))
        if not self.up:
            raise InferenceError(self.base_url, None, "connection refused")
        return {"success": True}

    async def health_generate(self, timeout_s=None):
        await self._call("health")

    async def pause_generation(self, mode):
        return await self._call("pause")

    async def continue_generation(self):
        return await self._call("continue")

    async def init_weights_update_group(self, **kw):
        return await self._call("init", **kw)

    async def destroy_weights_update_group(self, group_name, timeout_s=None):
        return await self._call("destroy", group_name=group_name)

    async def update_weights_from_distributed(self, **kw):
        return await self._call("update", **kw)


def group(generation):
    return {"master_address": "127.0.0.1", "master_port": 1, "world_size": 3, "num_senders": 1, "generation": generation,
            "group_name": group_name_of("slurmrl_weights", generation), "backend": "gloo", "names": [], "dtypes": [],
            "shapes": []}


async def started(tmp_path, workers):
    """Generation 0 announced, every worker joined it: (handshake, pool, coordinator)."""
    cfg = compose(["weights=broadcast", "weights.broadcast_timeout_s=5"])
    paths = RunPaths(tmp_path).ensure()
    hs = Handshake(paths.root)
    hs.write_group(group(0))
    pool = WorkerPool(workers, num_misses=1, timeout_s=1, log=LOG)
    coord = BroadcastCoordinator(cfg, paths, log=LOG)
    await coord.start(workers)
    return hs, pool, coord


async def scenario(tmp_path):
    workers = [FakeWorker("http://w0"), FakeWorker("http://w1")]
    hs, pool, coord = await started(tmp_path, workers)

    hs.offer(1)
    await coord.maybe_update(pool)
    assert coord.version == 1 and hs.requested() == 1

    workers[1].up = False
    assert await pool.check_live() == [1]
    hs.offer(2)
    await coord.maybe_update(pool)
    assert coord.version == 1 and hs.requested() == 1  # nothing requested while a member is dead
    assert not await coord.revive(pool, 1, lambda: (1, None))  # still down: nothing happens
    assert hs.reform_requested() == 0

    workers[1].up, workers[0].calls, workers[1].calls = True, [], []

    async def trainer():  # the senders see reform.json and announce generation 1
        while hs.reform_requested() != 1:
            await asyncio.sleep(0.01)
        hs.write_group(group(1))
    t = asyncio.create_task(trainer())
    assert not await coord.revive(pool, 1, lambda: (1, None))  # re-formed, but not live before an update
    await t
    assert coord.generation == 1 and coord.rejoined == {1} and not pool.alive[1]
    assert ("destroy", "slurmrl_weights", None) in workers[0].calls
    assert not any(c[0] == "destroy" for c in workers[1].calls)  # the new process has no group to leave
    assert all(("init", "slurmrl_weights.g1", None) in w.calls for w in workers)

    await coord.maybe_update(pool)  # the offered v2 goes to both, over the new group
    assert coord.version == 2 and pool.alive == [True, True]
    assert all(("update", "slurmrl_weights.g1", 2) in w.calls for w in workers)
    return pool


def test_revived_worker_rejoins_a_reformed_group_and_is_readmitted_by_the_next_update(tmp_path):
    pool = asyncio.run(scenario(tmp_path))
    assert pool.deaths == 1 and len(pool.recovery_s) == 1


class RestartedWorker(FakeWorker):
    """A worker whose process was replaced between two health checks: it answers health checks, but
    knows no weight group until it is asked to join one (a failed transfer, never a death seen)."""

    def __init__(self, url):
        super().__init__(url)
        self.groups = set()

    async def init_weights_update_group(self, **kw):
        self.groups.add(kw["group_name"])
        return await self._call("init", **kw)

    async def update_weights_from_distributed(self, **kw):
        await self._call("update", **kw)
        if kw["group_name"] not in self.groups:
            raise InferenceError(self.base_url, 500, f"no weight group {kw['group_name']!r}")
        return {"success": True}


async def restarted_scenario(tmp_path):
    workers = [FakeWorker("http://w0"), RestartedWorker("http://w1")]
    hs, pool, coord = await started(tmp_path, workers)
    hs.offer(1)
    await coord.maybe_update(pool)
    assert coord.version == 1

    workers[1].groups.clear()  # restarted: the old group is gone with the old process
    hs.offer(2)
    await coord.maybe_update(pool)
    assert coord.version == 1 and coord.broken and pool.alive == [True, True]  # failed in transit, nobody dead

    workers[0].calls, workers[1].calls = [], []
    hs.offer(3)

    async def trainer():  # the senders see reform.json (while waiting for a request) and announce generation 1
        while hs.reform_requested() != 1:
            await asyncio.sleep(0.01)
        hs.write_group(group(1))
    t = asyncio.create_task(trainer())
    await coord.maybe_update(pool)  # re-forms first, then requests v3 over the new group, whole
    await t
    return coord, hs, workers


def test_an_update_that_failed_in_transit_reforms_the_group_before_the_next_request(tmp_path):
    """Slurm respawned a server step within a second (tests/slurm/test_server_respawn.py under CI load):
    no health check missed, the next update failed on the old group. The senders stop on a second failure
    in one generation, so the next version must not be requested on that group: it is re-formed first."""
    coord, hs, workers = asyncio.run(restarted_scenario(tmp_path))
    assert coord.generation == 1 and not coord.broken and coord.version == 3 and hs.requested() == 3
    for w in workers:
        names = [c[0] for c in w.calls]
        assert names.index("init") < names.index("update")  # joined generation 1 before receiving v3
        assert ("update", "slurmrl_weights.g1", 3) in w.calls
        assert not any(c[0] == "update" and c[1] == "slurmrl_weights" for c in w.calls)
    assert hs.requested_mode() == "full"  # some worker may lack v2's base: whole


def test_a_content_refusal_keeps_the_group(tmp_path):
    """A worker that received the update and refused it (400: NaN, checksum) leaves the group intact."""
    async def run():
        workers = [FakeWorker("http://w0"), FakeWorker("http://w1")]
        hs, pool, coord = await started(tmp_path, workers)

        async def refuse(**kw):
            raise InferenceError("http://w1", 400, "weights hold NaN")
        workers[1].update_weights_from_distributed = refuse
        hs.offer(1)
        await coord.maybe_update(pool)
        return coord, hs
    coord, hs = asyncio.run(run())
    assert not coord.broken and coord.need_full and hs.reform_requested() == 0
