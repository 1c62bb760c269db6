"""The orchestrator's loop: keep inference busy, hand the trainer fresh-enough batches.

    until every trainer step has its batch:
        if the trainer published newer weights: pause -> load -> continue on every worker
        start as many prompt groups as the next batches can still use
        wait a moment for groups to finish; put them in the buffer
        while the buffer holds a batch for the next step: write it (stale groups dropped)

The bound on in-flight work (``max_inflight_rollouts``) and the staleness window
(``max_off_policy_steps``) are the only knobs; with a window of 0 this is synchronous
on-policy RL, with the same code.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Optional

import aiohttp

from workers.common.config import RunConfig
from workers.common.inference_client import InferenceClient, wait_until_ready
from workers.common.logs import get_logger
from workers.common.protocol import RunPaths, latest_stable_step, read_admin_token, write_json_atomic
from workers.common.topology import Topology
from workers.orchestrator.batch_builder import write_batch
from workers.orchestrator.buffer import RolloutBuffer, RolloutGroup, groups_to_launch
from workers.orchestrator.envs import make_env
from workers.orchestrator.envs.base import is_multi_turn
from workers.orchestrator.envs.latency import LatencyModel
from workers.orchestrator.episodes import env_batch_metrics, run_episode_group
from workers.orchestrator.rollouts import BusyMeter, WeightUpdateError, run_group, update_all_workers


class Orchestrator:
    def __init__(self, cfg: RunConfig, topo: Topology):
        self.cfg, self.topo = cfg, topo
        self.paths = RunPaths(topo.run_dir)
        self.log = get_logger("orchestrator", 0)
        self.env = make_env(cfg.env, seed=cfg.seed)
        o = cfg.orchestrator
        self.group_size = o.num_samples_per_prompt
        self.buffer = RolloutBuffer(max_off_policy_steps=o.max_off_policy_steps, groups_per_step=o.num_prompts_per_step,
                                    advantage=o.advantage, long_episode_policy=o.long_episode_policy)
        self.inflight: dict[asyncio.Task, int] = {}  # task -> worker index
        self.clients: list[InferenceClient] = []
        self.version = 0
        self.next_step = 0
        self.next_group_id = 0
        self.completions: deque[tuple[float, int]] = deque()  # (time, tokens) of finished groups
        self.dropped_at_last_batch = 0
        self.weight_update_s: Optional[float] = None
        self.started = time.monotonic()
        self.latency = LatencyModel(cfg.env, seed=cfg.seed) if cfg.env.latency != "none" else None
        self.meter = BusyMeter()
        self.busy_at_last_batch, self.time_at_last_batch = 0.0, time.monotonic()

    async def run(self) -> None:
        timeout = self.cfg.orchestrator.request_timeout_s
        token = read_admin_token(self.paths)
        async with aiohttp.ClientSession() as session:
            self.clients = [InferenceClient(u, token, session=session, timeout_s=timeout) for u in self.topo.inference_urls]
            await wait_until_ready(self.clients, self.cfg.inference.startup_timeout_s)
            self.log.info("%d inference workers ready; training %d steps", len(self.clients), self.cfg.trainer.num_steps)
            try:
                while self.next_step < self.cfg.trainer.num_steps:
                    await self.maybe_update_weights()
                    self.launch_groups()
                    await self.collect_finished(timeout_s=0.05)
                    self.write_ready_batches()
            finally:
                for task in self.inflight:
                    task.cancel()
                await asyncio.gather(*self.inflight, return_exceptions=True)
        self.paths.orchestrator_done.write_text(str(self.next_step))
        self.log.info("all %d batches written; done", self.next_step)

    async def maybe_update_weights(self) -> None:
        newest = latest_stable_step(self.paths.root / "weights")
        if newest is None or newest <= self.version:
            return
        try:
            self.weight_update_s = await update_all_workers(self.clients, str(self.paths.weights(newest)), newest)
            self.version = newest
        except WeightUpdateError as e:  # keep serving old weights; the next poll retries the newest step
            self.log.warning("%s", e)

    def launch_groups(self) -> None:
        o = self.cfg.orchestrator
        want = groups_to_launch(next_step=self.next_step, weight_version=self.version, max_off=o.max_off_policy_steps,
                                groups_per_step=o.num_prompts_per_step, buffered_usable=self.buffer.usable(self.next_step),
                                inflight_groups=len(self.inflight), spare=o.num_spare_groups)
        room = (o.max_inflight_rollouts - len(self.inflight) * self.group_size) // self.group_size
        for _ in range(max(0, min(want, room))):
            worker = self.least_loaded_worker()
            if is_multi_turn(self.env):  # episodes.py: turns, tools, sandbox (+ simulated latency per env step)
                task = asyncio.create_task(run_episode_group(
                    self.clients[worker], self.env, self.env.sample_task(), group_id=self.next_group_id, worker=worker,
                    num_samples=self.group_size, temperature=o.temperature, return_routed_experts=o.return_routed_experts,
                    started_version=self.version, meter=self.meter, latency=self.latency))
                self.inflight[task] = worker
                self.next_group_id += 1
                continue
            task = asyncio.create_task(run_group(
                self.clients[worker], self.env, self.env.sample_task(), group_id=self.next_group_id, worker=worker,
                num_samples=self.group_size, temperature=o.temperature,
                return_routed_experts=o.return_routed_experts, started_version=self.version,
                latency=self.latency, meter=self.meter))
            self.inflight[task] = worker
            self.next_group_id += 1

    def least_loaded_worker(self) -> int:
        load = [0] * len(self.clients)
        for w in self.inflight.values():
            load[w] += 1
        return min(range(len(load)), key=load.__getitem__)

    async def collect_finished(self, *, timeout_s: float) -> None:
        if not self.inflight:
            await asyncio.sleep(timeout_s)
            return
        done, _ = await asyncio.wait(self.inflight, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            self.inflight.pop(task)
            group: RolloutGroup = task.result()  # a failed request raises here with the worker's URL
            self.completions.append((time.monotonic(), sum(len(s.completion_ids) for s in group.samples)))
            self.buffer.add(group)

    def write_ready_batches(self) -> None:
        while self.next_step < self.cfg.trainer.num_steps:
            groups = self.buffer.take(self.next_step)
            if groups is None:
                return
            dropped_total = self.buffer.dropped_samples_total
            extra = {
                "samples_dropped_stale": dropped_total - self.dropped_at_last_batch,
                "samples_dropped_stale_total": dropped_total,
                "inference_tokens_per_s": self.inference_rate(),
                "orchestrator_weight_version": self.version,
                "inflight_groups": len(self.inflight),
                "weight_update_s": self.weight_update_s,
                "inference_busy_frac": self.busy_fraction(),
                "env_wait_s_total": self.meter.env_wait_s,
                **env_batch_metrics(groups), **self.long_episode_counters(),
            }
            write_batch(self.paths, self.next_step, groups, num_layers=self.cfg.model.num_layers,
                        top_k=self.cfg.model.top_k, temperature=self.cfg.orchestrator.temperature, extra_metrics=extra)
            self.dropped_at_last_batch = dropped_total
            write_json_atomic(self.paths.root / "orchestrator_state.json",
                              {"next_step": self.next_step + 1, "weight_version": self.version,
                               "groups_started": self.next_group_id, "dropped_total": dropped_total})
            self.next_step += 1


    def long_episode_counters(self) -> dict:
        """Totals of orchestrator.long_episode_policy (absent under the default ``drop``)."""
        b = self.buffer
        if b.policy == "drop":
            return {}
        return {"tokens_truncated_stale_total": b.tokens_truncated_total, "samples_truncated_stale_total":
                b.samples_truncated_total, "tokens_kept_stale_total": b.tokens_kept_stale_total}

    def busy_fraction(self) -> float:
        """Fraction of wall time since the previous batch with a generate request outstanding."""
        now, busy = time.monotonic(), self.meter.busy_total()
        frac = (busy - self.busy_at_last_batch) / max(now - self.time_at_last_batch, 1e-6)
        self.busy_at_last_batch, self.time_at_last_batch = busy, now
        return min(1.0, frac)

    def inference_rate(self, window_s: float = 10.0) -> float:
        """Completion tokens per second over the last ``window_s`` (batches come in bursts)."""
        now = time.monotonic()
        while self.completions and self.completions[0][0] < now - window_s:
            self.completions.popleft()
        if not self.completions:
            return 0.0
        span = max(now - self.completions[0][0], min(window_s, now - self.started))
        return sum(n for _, n in self.completions) / max(span, 1e-3)


def run_orchestrator(cfg: RunConfig, topo: Topology) -> None:
    asyncio.run(Orchestrator(cfg, topo).run())
