"""Event loop and the two server kinds every simulated role is built from.

Why processor sharing with a virtual clock: a decode replica runs all admitted sequences
in lock-step (one token each per iteration) and a prefill replica splits its FLOPs over
the requests it batches. Between two events (an arrival, a completion, a pause) the rate
is constant, so each server keeps one virtual clock (iterations done, or work done per
job) and only its *next* completion is on the heap: events scale with requests, not with
decode iterations, which keeps a 28-node, 10-step simulation around a second.

  StepServer  decode (or a unified embedded worker): n sequences at ``1 / step_s(n, ctx)``
              tokens/s each; bounded running set (max_running, KV tokens), FIFO admission,
              optional prefill stall on admission (the embedded engine prefills new
              requests before the next decode iteration)
  ShareServer prefill replica (work = FLOPs) or trainer (work = seconds): equal share
  CpuPool     local runs only: servers that are busy at once share ``cores`` CPUs, so
              each runs at ``min(1, cores / busy)`` of its calibrated speed
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Callable, Optional

EPS = 1e-9


class Sim:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._ids = itertools.count()
        self.num_events = 0

    def at(self, t: float, fn: Callable, *args) -> list:
        ev = [t, next(self._ids), fn, args, True]
        heapq.heappush(self._heap, ev)
        return ev

    def after(self, dt: float, fn: Callable, *args) -> list:
        return self.at(self.now + max(0.0, dt), fn, *args)

    @staticmethod
    def cancel(ev: Optional[list]) -> None:
        if ev is not None:
            ev[4] = False

    def run(self, stop: Callable[[], bool], *, max_time: float = float("inf"), max_events: int = 10**8) -> None:
        while self._heap and not stop() and self.num_events < max_events:
            ev = heapq.heappop(self._heap)
            if not ev[4]:
                continue
            if ev[0] > max_time:
                heapq.heappush(self._heap, ev)
                return
            self.now = ev[0]
            self.num_events += 1
            ev[2](*ev[3])


class CpuPool:
    def __init__(self, cores: float):
        self.cores, self.members, self.speed = cores, [], 1.0

    def join(self, server: "_Server") -> None:
        self.members.append(server)
        server.pool = self

    def changed(self) -> None:
        busy = sum(1 for m in self.members if m.busy)
        speed = min(1.0, self.cores / busy) if busy else 1.0
        if abs(speed - self.speed) > EPS:
            self.speed = speed
            for m in self.members:
                m.set_speed(speed)


class Job:
    """One request: ``size`` tokens (StepServer) or work units (ShareServer)."""

    __slots__ = ("size", "ctx", "on_done", "submitted", "admitted", "finish", "done_at", "payload")

    def __init__(self, size: float, on_done: Callable[["Job"], None], *, ctx: float = 0.0, payload=None):
        self.size, self.ctx, self.on_done, self.payload = size, ctx, on_done, payload
        self.submitted = self.admitted = self.done_at = 0.0
        self.finish = 0.0


class _Server:
    def __init__(self, sim: Sim, name: str):
        self.sim, self.name = sim, name
        self.speed, self.paused, self.pool = 1.0, False, None
        self.clock = 0.0  # virtual progress: iterations (StepServer) or work per job (ShareServer)
        self._rate = 0.0  # virtual progress per second, valid since self._last
        self._last = 0.0
        self._ev: Optional[list] = None
        self._heap: list = []
        self._ids = itertools.count()
        self._was_busy = False
        self.busy_time = 0.0
        self.done_size = 0.0

    @property
    def n(self) -> int:
        return len(self._heap)

    @property
    def busy(self) -> bool:
        return bool(self._heap) and not self.paused

    def _progress_since(self) -> float:
        return self._last

    def _advance(self) -> None:
        now = self.sim.now
        if self.busy:
            self.busy_time += now - self._last
            start = self._progress_since()
            if now > start:
                self.clock += (now - start) * self._rate
        self._last = now

    def _rate_now(self) -> float:
        raise NotImplementedError

    def _changed(self) -> None:
        if self._ev is not None:
            self._ev[4] = False  # cancel: the next completion moves with every change of state
            self._ev = None
        busy = self.busy
        if busy:
            rate = self._rate = self._rate_now()
            if rate > 0:
                now = self.sim.now
                wake = self._progress_since()
                wake = wake if wake > now else now
                dt = (self._heap[0][0] - self.clock) / rate
                self._ev = self.sim.at(wake + (dt if dt > 0 else 0.0), self._tick)
        if busy != self._was_busy:
            self._was_busy = busy
            if self.pool is not None:
                self.pool.changed()

    def set_speed(self, speed: float) -> None:
        self._advance()
        self.speed = speed
        self._changed()

    def pause(self) -> None:
        self._advance()
        self.paused = True
        self._changed()

    def resume(self) -> None:
        self._advance()
        self.paused = False
        self._changed()

    def _tick(self) -> None:
        self._ev = None
        self._advance()
        done = []
        limit = self.clock + EPS * max(1.0, abs(self.clock))
        heap = self._heap
        while heap and heap[0][0] <= limit:
            _, _, job = heapq.heappop(heap)
            self._release(job)
            job.done_at = self.sim.now
            self.done_size += job.size
            done.append(job)
        self._admit_waiting()
        self._changed()
        for job in done:
            job.on_done(job)

    def _release(self, job: Job) -> None:
        pass

    def _admit_waiting(self) -> None:
        pass


class ShareServer(_Server):
    """``capacity`` work units per second, split equally over the jobs present."""

    def __init__(self, sim: Sim, name: str, capacity: float):
        super().__init__(sim, name)
        self.capacity = capacity

    def _rate_now(self) -> float:
        return self.capacity * self.speed / len(self._heap)

    def submit(self, job: Job) -> None:
        self._advance()
        job.submitted = job.admitted = self.sim.now
        job.finish = self.clock + job.size
        heapq.heappush(self._heap, (job.finish, next(self._ids), job))
        self._changed()


class StepServer(_Server):
    """Lock-step decoding: every running sequence gains one token per iteration of ``step_s``."""

    def __init__(self, sim: Sim, name: str, step_s: Callable[[int, float], float], *, max_running: int,
                 kv_tokens: float = float("inf"), prefill_s: Optional[Callable[[int, float], float]] = None):
        super().__init__(sim, name)
        self.step_s, self.max_running, self.kv_tokens, self.prefill_s = step_s, max_running, kv_tokens, prefill_s
        self.waiting: deque[Job] = deque()
        self._ctx_base = 0.0  # sum over running jobs of (ctx at admission - clock at admission)
        self._reserved = 0.0  # KV tokens the running jobs will hold at their end
        self._stall_until = 0.0
        self._pending: list[Job] = []
        self._pending_ev: Optional[list] = None
        self.tokens_time = 0.0  # integral of running sequences over busy time (mean batch)

    @property
    def busy(self) -> bool:
        return (bool(self._heap) or self.sim.now < self._stall_until) and not self.paused

    def _progress_since(self) -> float:
        return max(self._last, self._stall_until)

    def _advance(self) -> None:
        if self._heap and not self.paused:
            self.tokens_time += (self.sim.now - self._last) * len(self._heap)
        super()._advance()

    def ctx_sum(self) -> float:
        return self._ctx_base + len(self._heap) * self.clock

    def _rate_now(self) -> float:
        n = len(self._heap)
        return self.speed / max(self.step_s(n, self._ctx_base + n * self.clock), 1e-12)

    def _fits(self, job: Job) -> bool:
        n = len(self._heap)
        if n >= self.max_running:
            return False
        return n == 0 or self._reserved + job.ctx + job.size <= self.kv_tokens

    def submit(self, job: Job) -> None:
        """Queue a request; admissions at one instant are prefilled together (one stall)."""
        job.submitted = self.sim.now
        self.waiting.append(job)
        if self.prefill_s is None:  # nothing to batch: admit now
            self._admit_now()
        elif self._pending_ev is None:
            self._pending_ev = self.sim.after(0.0, self._admit_now)

    def _admit_now(self) -> None:
        self._pending_ev = None
        if not self.waiting:
            return
        self._advance()
        self._admit_waiting()
        self._changed()

    def _admit_waiting(self) -> None:
        admitted = []
        while self.waiting and self._fits(self.waiting[0]):
            job = self.waiting.popleft()
            job.admitted = self.sim.now
            job.finish = self.clock + job.size
            self._ctx_base += job.ctx - self.clock
            self._reserved += job.ctx + job.size
            heapq.heappush(self._heap, (job.finish, next(self._ids), job))
            admitted.append(job)
        if admitted and self.prefill_s is not None:
            cost = self.prefill_s(len(admitted), sum(j.ctx for j in admitted)) / self.speed
            self._stall_until = max(self._stall_until, self.sim.now) + cost

    def _release(self, job: Job) -> None:
        self._ctx_base -= job.ctx - (job.finish - job.size)
        self._reserved -= job.ctx + job.size
