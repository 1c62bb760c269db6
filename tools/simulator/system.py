"""The simulated system: orchestrator rules, inference replicas, trainer, weight updates.

Why it mirrors workers/orchestrator/loop.py step by step: the point is to predict *this*
code. The same functions decide what happens:

  launch     ``groups_to_launch`` (buffer.py) with ``max_inflight_rollouts`` room; a group
             sticks to the least-loaded replica (prefill and decode chosen separately)
  buffer     the real ``RolloutBuffer``: a group's policy version is the oldest token's
             (the weights inference held when its first token was sampled); ``take(s)``
             drops groups with s - 1 - version > max_off_policy_steps and counts them
  weights    step s (1-based) trains from version s - 1 and publishes v = s; the orchestrator then pauses
             every replica (in place: in-flight requests keep their state), loads, resumes;
             nothing launches or is batched during the update (the real loop awaits it)
  trainer    waits for batch s, trains, publishes; idle time is waiting for a batch

A rollout walks its segments: prefill (prefix cache per prefill replica, LRU over
rollouts) -> KV transfer -> decode -> env wait; unified (embedded) workers prefill on the
decode replica itself. Local runs add the real code's polling delays (costs.*_poll_s).
"""
from __future__ import annotations

import dataclasses
import random
from collections import OrderedDict
from typing import Optional

from tools.simulator.engine import CpuPool, Job, ShareServer, Sim, StepServer
from tools.simulator.layout import Layout
from tools.simulator.workload import RolloutShape
from workers.orchestrator.buffer import RolloutBuffer, groups_to_launch


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopConfig:
    groups_per_step: int
    group_size: int
    max_off_policy_steps: int
    max_inflight_rollouts: int
    num_steps: int
    warmup_steps: int
    transport: str = "broadcast"
    delta_fraction: float = 0.0
    """weights.delta: the changed fraction per update the plan assumes (0: dense updates)."""
    seed: int = 0
    num_spare_groups: int = 0
    long_episode_policy: str = "drop"


class SimGroup:
    """Duck-typed RolloutGroup for the real RolloutBuffer (policy_version, samples, advantages)."""

    def __init__(self, gid: int, rollouts: list["Rollout"], launched: float):
        self.group_id, self.rollouts, self.launched = gid, rollouts, launched
        self.samples = rollouts
        self.policy_version = 0
        self.done = 0

    def assign_advantages(self, mode: str = "sequence", norm: str = "none", shaping=None) -> None:
        pass  # advantages do not change the timing


class Rollout:
    """One sample; ``newest_version`` and the empty token lists serve RolloutBuffer's
    long_episode_policy (truncate/keep check the newest turn's version; loss masks do not
    change the timing, so there are no tokens to mask)."""

    __slots__ = ("group", "shape", "seg", "version", "newest_version", "prefill", "decode", "t0", "phase_t", "times",
                 "kv", "transfer")
    token_versions: list = []

    def __init__(self, group: SimGroup, shape: RolloutShape, prefill: Optional[int], decode: int):
        self.group, self.shape, self.prefill, self.decode = group, shape, prefill, decode
        self.seg, self.version, self.newest_version, self.kv, self.transfer = 0, None, None, 0, 0.0
        self.t0 = self.phase_t = 0.0
        self.times = dict(prefill=0.0, transfer=0.0, decode=0.0, env=0.0)

    def loss_flags(self) -> list:
        return []


class System:
    def __init__(self, sim: Sim, costs, layout: Layout, workload, loop: LoopConfig, *, gpu_gb: float = 141.0):
        self.sim, self.costs, self.layout, self.workload, self.loop = sim, costs, layout, workload, loop
        self.rng = random.Random(loop.seed)
        self.pool = CpuPool(costs.cpu_cores) if costs.cpu_cores else None
        self.prefill: list[ShareServer] = []
        self.prefix: list[OrderedDict] = []
        self.prefix_cap: list[float] = []
        self.prefix_held: list[float] = []
        self.wset: list[float] = []  # per prefill replica: context tokens of its rollouts in flight
        self.decode: list[StepServer] = []
        for r in layout.of("prefill"):
            self.prefill.append(self._join(ShareServer(sim, f"prefill{r.index}", costs.prefill_rate(r))))
            self.prefix.append(OrderedDict())
            self.prefix_cap.append(costs.prefix_cache_tokens(r, gpu_gb))
            self.prefix_held.append(0.0)
            self.wset.append(0.0)
        unified = bool(layout.of("unified"))
        for r in layout.of("unified") or layout.of("decode"):
            step = costs.decode_step_fn(r) if hasattr(costs, "decode_step_fn") else (
                lambda n, ctx, r=r: costs.decode_step_s(r, n, ctx))
            self.decode.append(self._join(StepServer(
                sim, f"{r.kind}{r.index}", step, max_running=costs.max_running(r),
                kv_tokens=costs.kv_capacity_tokens(r, gpu_gb),
                prefill_s=(lambda k, tokens, r=r: costs.unified_prefill_s(r, k, tokens)) if unified else None)))
        self.trainer = self._join(ShareServer(sim, "trainer", 1.0))
        # Local runs: the orchestrator process turns each finished group into buffer entries
        # (responses, rewards, advantages) on the same shared CPUs; at scale it has its own node.
        self.orch_cpu_s = getattr(costs, "orch_cpu_s_per_group", 0.0)
        self.orchestrator = self._join(ShareServer(sim, "orchestrator", 1.0)) if self.orch_cpu_s else None
        self.buffer = RolloutBuffer(max_off_policy_steps=loop.max_off_policy_steps, groups_per_step=loop.groups_per_step,
                                    long_episode_policy=loop.long_episode_policy)
        self.version = self.published = 0
        self.updating = False
        self.next_step = 1  # next batch the orchestrator writes (1-based steps, as the orchestrator's)
        self.inflight: list[SimGroup] = []
        self.ready: dict[int, list[SimGroup]] = {}
        self.train_step = 0  # steps trained; the next one trains batch train_step + 1
        self.training = False
        self.step_end: list[float] = []
        self.step_tokens: list[int] = []
        self.used_groups: list[SimGroup] = []
        self.finished: list[SimGroup] = []
        self.load = [0] * len(self.decode)
        self.pload = [0] * len(self.prefill)
        self.gid = 0
        self.publish_s, self.sync_s = costs.weight_sync(layout.replicas, loop.transport,
                                                          delta_fraction=loop.delta_fraction)
        self.snap: dict = {}

    def _join(self, server):
        if self.pool is not None:
            self.pool.join(server)
        return server

    # -- orchestrator ----------------------------------------------------------------------------
    def run(self, *, max_time: float = 3.0e6) -> None:
        self.sim.after(0.0, self.orchestrate)
        self.sim.run(lambda: self.train_step >= self.loop.num_steps, max_time=max_time)

    def orchestrate(self) -> None:
        if self.updating:
            return
        if self.published > self.version:
            self._update_weights(self.published)
            return
        self._launch()
        self._write_batches()

    def _update_weights(self, version: int) -> None:
        self.updating = True
        servers = self.prefill + self.decode
        for s in servers:
            s.pause()

        def done() -> None:
            for s in servers:
                s.resume()
            self.version, self.updating = version, False
            self.orchestrate()
        self.sim.after(self.sync_s, done)

    def _launch(self) -> None:
        lp = self.loop
        want = groups_to_launch(next_step=self.next_step, weight_version=self.version, max_off=lp.max_off_policy_steps,
                                groups_per_step=lp.groups_per_step, buffered_usable=self.buffer.usable(self.next_step),
                                inflight_groups=len(self.inflight), spare=lp.num_spare_groups)
        room = (lp.max_inflight_rollouts - len(self.inflight) * lp.group_size) // lp.group_size
        for _ in range(max(0, min(want, room))):
            d = min(range(len(self.decode)), key=self.load.__getitem__)
            p = min(range(len(self.prefill)), key=self.pload.__getitem__) if self.prefill else None
            self.load[d] += 1
            if p is not None:
                self.pload[p] += 1
            group = SimGroup(self.gid, [], self.sim.now)
            self.gid += 1
            group.rollouts[:] = [Rollout(group, s, p, d) for s in self.workload.group(self.rng, lp.group_size)]
            self.inflight.append(group)
            for r in group.rollouts:
                r.t0 = self.sim.now
                self.sim.after(r.shape.start_s, self._segment, r)

    def _write_batches(self) -> None:
        while self.next_step <= self.loop.num_steps:
            groups = self.buffer.take(self.next_step)
            if groups is None:
                return
            self.ready[self.next_step] = groups
            self.next_step += 1
            self.sim.after(self.costs.trainer_poll_s, self._train)

    # -- rollouts ----------------------------------------------------------------------------------
    def _segment(self, r: Rollout) -> None:
        seg = r.shape.segments[r.seg]
        r.phase_t = self.sim.now
        if r.prefill is None:  # unified worker: the decode replica prefills on admission
            self._first_token(r)
            self._decode(r, seg.ctx_start + seg.prefill_tokens)
            return
        p, cache = r.prefill, self.prefix[r.prefill]
        had, had_size = cache.pop(id(r), (0, 0.0))
        turns = seg.turns or ((seg.ctx_start, seg.ctx_start + seg.prefill_tokens),)
        flops = self.costs.prefill_flops
        # The first merged turn sees the LRU cache as it is. The later ones would miss when the
        # contexts of every rollout in flight on this replica (its working set W) exceed the
        # cache C: they are charged a recompute with probability max(0, 1 - C / W), the hit rate
        # of a cache C under independent references to W (test_sim_model checks merged vs per turn).
        end = seg.ctx_start + seg.prefill_tokens
        size = sum(e for _, e in turns) / len(turns)
        self.wset[p] += size - r.kv
        r.kv = size
        m = max(0.0, 1.0 - self.prefix_cap[p] / max(self.wset[p], 1.0))
        start0, end0 = turns[0]
        first = flops(end0 - had, had) if had < start0 else flops(end0 - start0, start0)
        work = first + sum(m * flops(e, 0) + (1 - m) * flops(e - s0, s0) for s0, e in turns[1:])
        # The entry covers the prefix up to the segment's end; it counts against the cache at the
        # size it has on average over the merged turns (it grows turn by turn in reality).
        cache[id(r)] = (end, size)
        held = self.prefix_held[p] - had_size + size
        while held > self.prefix_cap[p] and cache:
            held -= cache.popitem(last=False)[1][1]  # LRU: the rollout that waited longest loses its prefix
        self.prefix_held[p] = held
        self.prefill[r.prefill].submit(Job(work, lambda job: self._prefilled(r), payload=r))

    def _prefilled(self, r: Rollout) -> None:
        """The KV transfer to decode is pure latency: it is served with the env wait after the
        decode (same per-rollout time, one event less per turn); its seconds are reported apart."""
        seg = r.shape.segments[r.seg]
        self._first_token(r)
        r.times["prefill"] += self.sim.now - r.phase_t
        r.phase_t = self.sim.now
        r.transfer = self.costs.kv_transfer_s(seg.transfer_tokens)
        r.times["transfer"] += r.transfer
        self._decode(r, seg.ctx_start + seg.prefill_tokens)

    def _decode(self, r: Rollout, ctx: float) -> None:
        seg = r.shape.segments[r.seg]
        self.decode[r.decode].submit(Job(seg.decode_tokens, lambda job: self._decoded(r), ctx=ctx, payload=r))

    def _first_token(self, r: Rollout) -> None:
        """Versions of this segment's first token: the oldest (the group's) and the newest turn's."""
        if r.version is None:
            r.version = self.version
        r.newest_version = self.version

    def _decoded(self, r: Rollout) -> None:
        seg = r.shape.segments[r.seg]
        r.times["decode"] += self.sim.now - r.phase_t
        r.phase_t = self.sim.now
        self.sim.after(seg.env_s + r.transfer, self._env_done, r)

    def _env_done(self, r: Rollout) -> None:
        r.times["env"] += self.sim.now - r.phase_t - r.transfer
        r.transfer = 0.0
        r.seg += 1
        if r.seg < len(r.shape.segments):
            self._segment(r)
            return
        if r.prefill is not None:
            self.prefix_held[r.prefill] -= self.prefix[r.prefill].pop(id(r), (0, 0.0))[1]
            self.wset[r.prefill] -= r.kv
        g = r.group
        g.done += 1
        if g.done == len(g.rollouts):
            g.policy_version = min(x.version for x in g.rollouts)
            self.load[r.decode] -= 1
            if r.prefill is not None:
                self.pload[r.prefill] -= 1
            if self.orchestrator is not None:
                self.orchestrator.submit(Job(self.orch_cpu_s, lambda job: self._group_done(g)))
            else:
                self._group_done(g)

    def _group_done(self, g: SimGroup) -> None:
        self.inflight.remove(g)
        g.finished_at = self.sim.now
        self.finished.append(g)
        self.buffer.add(g)
        self.orchestrate()

    # -- trainer -----------------------------------------------------------------------------------
    def _train(self) -> None:
        if self.training or self.train_step + 1 not in self.ready:
            return
        groups = self.ready.pop(self.train_step + 1)
        lengths = [r.shape.total_tokens for g in groups for r in g.rollouts]
        self.training = True
        self.used_groups += groups
        self.step_tokens.append(sum(lengths))
        sleep = self.costs.train_sleep_s()  # local benchmarks' simulated_step_delay_s: no CPU used

        def computed(job: Job) -> None:
            self.sim.after(sleep, self._trained) if sleep else self._trained()
        self.trainer.submit(Job(self.costs.train_s(lengths) + self.publish_s, computed))

    def _trained(self) -> None:
        self.training = False
        self.train_step += 1
        self.step_end.append(self.sim.now)
        self.published = self.train_step
        if self.train_step == self.loop.warmup_steps:
            self.snapshot()
        self.sim.after(self.costs.orch_poll_s, self.orchestrate)
        self._train()

    def snapshot(self) -> None:
        """Counters at the end of warm-up: the report measures the steady state after it."""
        self.snap = {"t": self.sim.now, "dropped": self.buffer.dropped_samples_total, "finished": len(self.finished),
                     "used": len(self.used_groups), "servers": {s.name: (s.busy_time, s.done_size, getattr(s, "tokens_time", 0.0))
                                                                for s in self.prefill + self.decode + [self.trainer]}}

    # -- report ------------------------------------------------------------------------------------
    def summary(self) -> dict:
        """Steady-state numbers after warm-up: step time, per-role busy/utilization, bottleneck."""
        if self.train_step < self.loop.num_steps or not self.snap:
            return {"error": f"stalled after {self.train_step} of {self.loop.num_steps} steps at t={self.sim.now:.1f}s"}
        t0, t1 = self.snap["t"], self.sim.now
        win = max(t1 - t0, 1e-12)
        ends = self.step_end[self.loop.warmup_steps - 1:]
        step_s = (ends[-1] - ends[0]) / max(1, len(ends) - 1)
        roles: dict[str, dict] = {}
        for s in self.prefill + self.decode + [self.trainer]:
            b0, d0, n0 = self.snap["servers"][s.name]
            busy = (s.busy_time - b0) / win
            kind = s.name.rstrip("0123456789")
            agg = roles.setdefault(kind, {"busy": 0.0, "util": 0.0, "count": 0, "tokens_s": 0.0, "batch": 0.0})
            agg["count"] += 1
            agg["busy"] += busy
            if isinstance(s, StepServer):
                tok_s = (s.done_size - d0) / win
                agg["tokens_s"] += tok_s
                agg["batch"] += (s.tokens_time - n0) / max(s.busy_time - b0, 1e-12)
                agg["util"] += tok_s / max(self._decode_capacity(s), 1e-12)
            else:
                agg["util"] += busy
        for agg in roles.values():
            for k in ("busy", "util", "batch"):
                agg[k] /= agg["count"]
        used = self.used_groups[self.snap["used"]:]
        rolls = [r for g in used for r in g.rollouts]
        lat = sorted(g.finished_at - g.launched for g in used)
        parts = {k: sum(r.times[k] for r in rolls) / max(1, len(rolls)) for k in ("prefill", "transfer", "decode", "env")}
        fin = [r for g in self.finished[self.snap["finished"]:] for r in g.rollouts]
        dropped = self.buffer.dropped_samples_total - self.snap["dropped"]
        out = {
            "step_s": step_s, "num_steps_measured": len(ends) - 1,
            "trainer_idle_frac": 1 - roles["trainer"]["busy"],
            "roles": roles, "weight_sync_s": self.sync_s, "weight_publish_s": self.publish_s,
            "rollout_latency_mean_s": sum(lat) / max(1, len(lat)),
            "rollout_latency_p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else 0.0,
            "latency_parts_s": parts,
            "samples_dropped_frac": dropped / max(1, dropped + len(rolls)),
            "tokens_per_step": sum(self.step_tokens[self.loop.warmup_steps:]) / max(1, len(ends) - 1),
            "train_tokens_mean": sum(r.shape.total_tokens for r in rolls) / max(1, len(rolls)),
            "finished_tokens_mean": sum(r.shape.total_tokens for r in fin) / max(1, len(fin)),
            "events": self.sim.num_events,
        }
        out["bottleneck"] = bottleneck(out, self.loop)
        return out

    def _decode_capacity(self, s: StepServer) -> float:
        """Tokens/s of one replica at the largest batch its KV cache and max_running allow."""
        ctx = max(1.0, sum(r.shape.total_tokens for g in self.finished for r in g.rollouts)
                  / max(1, sum(len(g.rollouts) for g in self.finished)) / 2)
        n = int(max(1, min(s.max_running, s.kv_tokens / ctx)))
        return n / s.step_s(n, n * ctx)


def bottleneck(out: dict, loop: LoopConfig) -> str:
    """The role that limits the step: the trainer, a saturated inference role, or rollout latency.

    Latency-bound means no GPU role is saturated: in flight are about max(1, max_off) steps'
    worth of groups (groups_to_launch), so by Little's law a step takes about the mean rollout
    latency divided by that; the largest part of a rollout's time is named.
    """
    roles = out["roles"]
    if roles["trainer"]["busy"] >= 0.95:
        return f"trainer compute ({roles['trainer']['busy']:.0%} busy)"
    hot = max(((k, v["util"]) for k, v in roles.items() if k != "trainer"), key=lambda kv: kv[1], default=("", 0.0))
    if hot[1] >= 0.85:
        return f"{hot[0]} throughput ({hot[1]:.0%} utilized)"
    parts = out["latency_parts_s"]
    worst = max(parts, key=parts.get)
    total = sum(parts.values()) or 1.0
    return (f"rollout latency: {worst} {parts[worst] / total:.0%} of {total:.0f} s/rollout, "
            f"~{max(1, loop.max_off_policy_steps)} step(s) of groups in flight")
