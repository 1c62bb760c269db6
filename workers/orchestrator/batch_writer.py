"""Writing each ready batch and what its record reports, for the orchestrator's loop (loop.py).

Why a module of its own: the loop (loop.py) decides *when* work starts and finishes (weights,
evals, groups, workers); this side decides what leaves the orchestrator once a step's groups
are in the buffer: the batch file (batch_builder.py does the format), the ledger's record of it,
``orchestrator_state.json`` for a restart, the batch's timeline record, and its metrics, with
the counters and heartbeats behind them (the inference workers' heartbeats are polled here,
``watch_inference``, because only the batch metrics read them). It also stops a run whose every
reward call fails (``RewardsFailing``), since that is read off the same metrics.

:class:`BatchWriter` is a mixin of the Orchestrator: it reads the loop's state (buffer, ledger,
weights coordinator, meters, pool, evaluator, env) and advances ``next_step``.
"""
from __future__ import annotations

import asyncio
import time

import aiohttp

from workers.common.inference_client import InferenceError
from workers.common.protocol import write_json_atomic
from workers.common.timeline import now
from workers.orchestrator.adapters import adapter_metrics
from workers.orchestrator.batch_builder import write_batch
from workers.orchestrator.buffer import RolloutGroup
from workers.orchestrator.episodes import env_batch_metrics
from workers.orchestrator.evaluation import log_samples, reward_metrics
from workers.weights.lora_coordinator import LoraCoordinator

HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S = 10.0, 5.0


class RewardsFailing(RuntimeError):
    """Every reward call failed for orchestrator.max_failed_reward_steps batches: the user's reward is broken."""


class BatchWriter:
    """The Orchestrator's batch side (see the module docstring); every attribute it uses is set in
    ``Orchestrator.__init__``."""

    def write_ready_batches(self) -> None:
        while self.next_step <= self.cfg.trainer.num_steps:
            before = {g.group_id for g in self.buffer.groups}
            groups = self.buffer.take(self.next_step)
            self.ledger.drop(before - {g.group_id for g in self.buffer.groups} - {g.group_id for g in groups or []})
            if groups is None:
                return
            write_start = now()
            dropped_total = self.buffer.dropped_samples_total
            extra = {
                "samples_dropped_stale": dropped_total - self.dropped_at_last_batch,
                "samples_dropped_stale_total": dropped_total,
                "inference_tokens_per_s": self.rate.rate(),
                "orchestrator_weight_version": self.version,
                "inflight_groups": len(self.inflight),
                "weight_update_s": self.weights.update_s,
                "weight_updates_verified": self.weights.verified,
                "weight_updates_mismatched": self.weights.mismatched,
                "weight_updates_fallback": self.weights.fallbacks,
                **(dict(self.weights.metrics(), samples_dropped_unconfirmed_total=self.dropped_unconfirmed)
                   if isinstance(self.weights, LoraCoordinator) else {}),
                "weight_updates_refused": self.weights.refused,
                "inference_busy_frac": self.busy_fraction(),
                "env_wait_s_total": self.meter.env_wait_s,
                "inference_workers_live": len(self.pool.live()),
                "inference_worker_deaths_total": self.pool.deaths,
                "groups_resubmitted_total": sum(self.ledger.resubmits.values()),
                **env_batch_metrics(groups), **adapter_metrics(groups, self.adapters),
                **self.long_episode_counters(), **self.buffer.sampling_metrics(groups),
                **reward_metrics([s for g in groups for s in g.samples]), **self.env.metrics(),
                **self.evaluator.take_result(),
                **{f"orchestrator_{k}": v for k, v in self.beat.sample().items()},
                **self.inference_heartbeat(),
            }
            self.check_reward_failures(extra)
            every = self.cfg.orchestrator.log_samples_every_steps
            if every and self.next_step % every == 0:  # text in the log; metrics.jsonl, TensorBoard and W&B
                extra["samples"] = log_samples(self.log, self.env, self.next_step, groups,
                                               self.cfg.orchestrator.num_logged_samples)
            write_batch(self.paths, self.next_step, groups, num_layers=self.cfg.model.num_routed_layers,
                        top_k=self.cfg.model.top_k, temperature=self.cfg.orchestrator.temperature, extra_metrics=extra,
                        adapters=self.adapters)
            self.ledger.batch(self.next_step, [g.group_id for g in groups])  # after READY: recover_batches covers the gap
            self.timeline_batch(groups, write_start)
            self.dropped_at_last_batch = dropped_total
            write_json_atomic(self.paths.root / "orchestrator_state.json",
                              {"next_step": self.next_step + 1, "weight_version": self.version,
                               "groups_started": self.next_group_id, "dropped_total": dropped_total,
                               "env_state": self.env.state()})
            self.next_step += 1

    def check_reward_failures(self, metrics: dict) -> None:
        """RewardsFailing once every reward call of ``orchestrator.max_failed_reward_steps`` consecutive
        batches failed: such a run trains on zeros only (every sample scores 0), so it stops, naming
        the first failure, instead of finishing with rc 0 and reward 0.000 on every line."""
        limit = self.cfg.orchestrator.max_failed_reward_steps
        calls = metrics.get("reward_calls", 0)
        all_failed = calls > 0 and metrics.get("reward_failures", 0) >= calls
        self.failed_reward_steps = self.failed_reward_steps + 1 if all_failed else 0
        if limit and self.failed_reward_steps >= limit:
            first = getattr(self.env, "first_failure", None) or "(not recorded)"
            raise RewardsFailing(f"every reward call failed for {self.failed_reward_steps} consecutive steps "
                                 f"(orchestrator.max_failed_reward_steps={limit}; 0 never stops): the first failure: "
                                 f"{first}")

    def long_episode_counters(self) -> dict:
        """Totals of orchestrator.long_episode_policy (absent under the default ``drop``)."""
        b = self.buffer
        if b.policy == "drop":
            return {}
        return {"tokens_truncated_stale_total": b.tokens_truncated_total, "samples_truncated_stale_total":
                b.samples_truncated_total, "tokens_kept_stale_total": b.tokens_kept_stale_total}

    def busy_fraction(self) -> float:
        """Fraction of wall time since the previous batch with a generate request outstanding."""
        t, busy = time.monotonic(), self.meter.busy_total()
        frac = (busy - self.busy_at_last_batch) / max(t - self.time_at_last_batch, 1e-6)
        self.busy_at_last_batch, self.time_at_last_batch = busy, t
        return min(1.0, frac)

    def timeline_batch(self, groups: list[RolloutGroup], write_start: float) -> None:
        """The timeline's ``batch`` record of the batch just written (workers/common/timeline.py defines each mark)."""
        done = [self.group_done_at.pop(g.group_id) for g in groups if g.group_id in self.group_done_at]
        busy = self.meter.busy_total() - self.paused_busy_s
        generation_s, self.gen_busy_at_last_batch = busy - self.gen_busy_at_last_batch, busy
        env_s = [s.env_info.get("env_s") for g in groups for s in g.samples]
        self.timeline.write("batch", self.next_step, first_group_done=min(done, default=None),
                            last_group_done=max(done, default=None), write_start=write_start, batch_written=now(),
                            generation_s=max(0.0, generation_s), groups=len(groups),
                            reward_s=max((float(e) for e in env_s if isinstance(e, (int, float))), default=None))

    async def watch_inference(self) -> None:
        """Every HEARTBEAT_INTERVAL_S: each live worker's heartbeat (its /server_info ``heartbeat``: RSS,
        GPU memory and utilization; the embedded server has one, SGLang's answer has none and is
        skipped), kept for the next batch's metrics as ``inference_<key>_max`` over the workers. A
        worker that does not answer is the health checks' business (loop.py watch_workers), not this one's."""
        while True:
            for w in self.pool.live():
                try:
                    info = await asyncio.wait_for(self.clients[w].server_info(), HEARTBEAT_TIMEOUT_S)
                except (InferenceError, asyncio.TimeoutError, aiohttp.ClientError):
                    continue
                if isinstance(info.get("heartbeat"), dict):
                    self.inference_beats[w] = info["heartbeat"]
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    def inference_heartbeat(self) -> dict:
        out: dict[str, float] = {}
        for beat in self.inference_beats.values():
            for k, v in beat.items():
                if isinstance(v, (int, float)):
                    out[f"inference_{k}_max"] = max(out.get(f"inference_{k}_max", v), v)
        return out
