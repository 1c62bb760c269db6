"""Which inference workers are alive, and bringing a restarted one back into service.

Why a separate piece: the loop must keep training while workers die and come back
(a node lost, an OOM, a SIGKILL), and the rules are easy to get subtly wrong:

- A worker is marked dead when a request to it fails without an HTTP answer (refused or
  reset connection, timeout) or when it misses ``orchestrator.num_health_misses``
  consecutive health checks (``/health_generate``, deadline
  ``orchestrator.health_check_timeout_s``, every ``orchestrator.health_check_interval_s``).
  A dead worker gets no new groups and no weight updates; the loop resubmits its in-flight
  groups elsewhere with the same group/task ids (ledger.py).
- A dead worker is probed with the same health check. Once it answers (the launcher
  respawned it, or Slurm started a new step), it is brought to the orchestrator's CURRENT
  weight version before it serves: ``/update_weights_from_disk weights/step_V`` (the
  restarted server itself starts from the newest STABLE step, which may be older than V
  when the orchestrator lags or newer than a pruned V; either way it is told V when V's
  directory still exists). Only then is it live again. If the orchestrator moved on to a
  newer version during that load, the worker is updated again before it is marked live.

- A worker marked dead leaves a weight update in progress at once (:meth:`WorkerPool.gone`: the
  swap stops waiting on it; it loads the current weights when it comes back), and it is listed
  in ``run_dir/inference_health.json``: the launcher (local) or the Slurm supervisor kills a
  dead worker whose process still runs (hung: SIGSTOP, a wedged GPU) after
  ``launcher.hung_worker_kill_s`` and restarts it.

Protocol per revival (orchestrator drives, worker obeys; every call has a deadline):
  health_generate ok -> update_weights_from_disk(step_V, V) [409, V older than the worker's own
  step: again with allow_rollback] -> [repeat while V changed] -> live.
The transport's coordinator decides (``WeightCoordinator.revive``): the filesystem transport
uses :meth:`WorkerPool.try_revive` above; the broadcast transport re-forms its group with the
revived workers and readmits them after the next update reached them
(workers/weights/broadcast/coordinator.py).
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from workers.common.inference_client import InferenceClient, InferenceError
from workers.common.protocol import write_json_atomic


class WorkerPool:
    """Liveness of each worker index; the loop asks ``live()`` before sending anything."""

    def __init__(self, clients: Sequence[InferenceClient], *, num_misses: int, timeout_s: float, log,
                 on_event: Optional[Callable[..., None]] = None, health_file: Optional[Path] = None,
                 kill_after_s: float = 0.0):
        """``health_file``: where the dead workers are listed for the supervisors (:meth:`write_health`),
        with ``kill_after_s`` (launcher.hung_worker_kill_s)."""
        self.clients = list(clients)
        self.alive = [True] * len(self.clients)
        self.misses = [0] * len(self.clients)
        self.down_since: dict[int, float] = {}
        self.dead_wall: dict[int, float] = {}  # worker -> wall time it was marked dead (for the supervisors)
        # worker -> wall time it last answered (the pool starts once every server answered): a supervisor
        # kills only a process that answered after it started, never a replacement still loading
        self.last_ok = [time.time()] * len(self.clients)
        self._gone: dict[int, asyncio.Event] = {}
        self.num_misses, self.timeout_s, self.log = num_misses, timeout_s, log
        self.on_event = on_event or (lambda ev, **kw: None)
        self.health_file, self.kill_after_s = health_file, kill_after_s
        self.deaths = 0
        self.recovery_s: list[float] = []
        self.write_health()

    def gone(self, client: InferenceClient) -> Optional[asyncio.Event]:
        """Set once ``client``'s worker is marked dead: a weight update waiting on it leaves it at
        once (workers/weights/coordinator.swap_weights); None for a client not in the pool."""
        try:
            w = self.clients.index(client)
        except ValueError:
            return None
        return self._gone.setdefault(w, asyncio.Event())

    def write_health(self) -> None:
        """``run_dir/inference_health.json``: the dead workers and since when (wall time), and the
        bound after which the launcher or the Slurm supervisor kills a dead worker that still runs."""
        if self.health_file is None:
            return
        body = {"time": time.time(), "kill_after_s": self.kill_after_s,
                "dead": {str(w): {"since": t, "last_ok": self.last_ok[w], "url": self.clients[w].base_url}
                         for w, t in sorted(self.dead_wall.items())}}
        try:
            write_json_atomic(self.health_file, body)
        except OSError as e:  # the run dir is the supervisors' business; the pool goes on
            self.log.warning("cannot write %s: %s", self.health_file, e)

    def live(self) -> list[int]:
        return [i for i, a in enumerate(self.alive) if a]

    def live_clients(self) -> list[InferenceClient]:
        return [self.clients[i] for i in self.live()]

    def mark_dead(self, worker: int, reason: str) -> bool:
        """Stop sending to ``worker``; True when it was live until now."""
        if not self.alive[worker]:
            return False
        self.alive[worker] = False
        self.down_since[worker] = time.monotonic()
        self.dead_wall[worker] = time.time()
        self._gone.setdefault(worker, asyncio.Event()).set()
        self.write_health()
        self.deaths += 1
        self.log.warning("inference worker %d (%s) marked dead: %s", worker, self.clients[worker].base_url,
                         reason[:300])
        self.on_event("worker_dead", worker=worker, reason=reason[:300])
        return True

    def request_failed(self, worker: int, err: BaseException) -> bool:
        """A group's request failed; no HTTP answer at all means the worker is gone."""
        if isinstance(err, InferenceError) and err.status is None:
            return self.mark_dead(worker, str(err))
        return False

    async def healthy(self, worker: int) -> bool:
        """One health check of ``worker`` (live or dead), with the pool's deadline."""
        try:
            await self.clients[worker].health_generate(timeout_s=self.timeout_s)
            return True
        except InferenceError:
            return False

    async def check_live(self) -> list[int]:
        """One health round over live workers; returns the ones newly marked dead."""
        newly = []
        for w in self.live():
            if await self.healthy(w):
                self.misses[w], self.last_ok[w] = 0, time.time()
                continue
            self.misses[w] += 1
            if self.misses[w] >= self.num_misses and self.mark_dead(w, f"missed {self.misses[w]} health checks"):
                newly.append(w)
        return newly

    async def try_revive(self, worker: int, current: Callable[[], tuple[int, Optional[str]]]) -> bool:
        """If dead ``worker`` answers again, load the current weights onto it and mark it live.

        ``current()`` returns (version, model_path or None when that step dir is gone).
        """
        if self.alive[worker] or not await self.healthy(worker):
            return False
        loaded = None
        for _ in range(5):  # the version may move on while we load; chase it a few times
            version, path = current()
            if version == loaded:
                break
            if path is None:
                break  # pruned: the worker's own newest STABLE is at least as new
            try:
                await self.load_current(worker, path, version)
            except InferenceError as e:
                self.log.warning("revived worker %d refused weights v%d: %s", worker, version, e)
                return False
            loaded = version
        self.readmit(worker, loaded)
        return True

    async def load_current(self, worker: int, path: str, version: int) -> None:
        """Bring a reviving ``worker`` to ``version``. A worker that booted from a newer step answers
        409 (a version going backwards); the orchestrator then asks for that rollback explicitly."""
        client = self.clients[worker]
        try:
            await client.update_weights_from_disk(path, version, timeout_s=self.timeout_s * 10)
        except InferenceError as e:
            if e.status != 409:
                raise
            self.log.info("revived worker %d serves a newer step than v%d: rolling it back", worker, version)
            await client.update_weights_from_disk(path, version, timeout_s=self.timeout_s * 10, allow_rollback=True)

    def readmit(self, worker: int, version: Optional[int]) -> None:
        """``worker`` serves weights ``version`` again: live from now on (a transport's revival ends here)."""
        self.alive[worker], self.misses[worker], self.last_ok[worker] = True, 0, time.time()
        self._gone[worker] = asyncio.Event()
        self.dead_wall.pop(worker, None)
        self.write_health()
        down = time.monotonic() - self.down_since.pop(worker, time.monotonic())
        self.recovery_s.append(down)
        self.log.info("inference worker %d back after %.1fs with weights v%s", worker, down, version)
        self.on_event("worker_back", worker=worker, down_s=round(down, 3), version=version)
