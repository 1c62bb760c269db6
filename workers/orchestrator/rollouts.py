"""Rollout mechanics: run one prompt group on a worker.

Weight updates (the only sync point between inference and training) are the transport's
coordinator's job: workers/weights/coordinator.py (pause -> load or send -> verify ->
continue) and workers/weights/<transport>/coordinator.py.
Requests that spanned an update carry per-token versions, so staleness stays exact.
Every call has the client's timeout; failures carry the worker URL and response text.
"""
from __future__ import annotations

import asyncio
import time

from workers.common.inference_client import InferenceClient
from workers.orchestrator.buffer import RolloutGroup, Sample


class BusyMeter:
    """Wall time during which at least one generate request is outstanding (inference busy)."""

    def __init__(self):
        self.active, self.busy_s, self.since = 0, 0.0, time.monotonic()
        self.env_wait_s = 0.0

    def enter(self) -> None:
        if self.active == 0:
            self.since = time.monotonic()
        self.active += 1

    def exit(self) -> None:
        self.active -= 1
        if self.active == 0:
            self.busy_s += time.monotonic() - self.since

    def busy_total(self) -> float:
        return self.busy_s + (time.monotonic() - self.since if self.active else 0.0)


async def run_group(client: InferenceClient, env, task, *, group_id: int, worker: int, num_samples: int,
                    temperature: float, return_routed_experts: bool, started_version: int,
                    latency=None, meter: BusyMeter | None = None) -> RolloutGroup:
    """Sample ``num_samples`` completions of one task on one worker (sticky: shared prefix).

    ``latency`` (envs.latency.LatencyModel) adds a simulated env-step wait per episode after
    generation; ``meter`` records when inference had work.
    """
    async def one(i: int) -> Sample:
        if meter is not None:
            meter.enter()
        try:
            res = await client.generate(list(task.prompt_ids), temperature=temperature,
                                        max_new_tokens=env.max_new_tokens, stop_token_ids=list(env.stop_token_ids),
                                        return_routed_experts=return_routed_experts, rid=f"g{group_id}-s{i}")
        finally:
            if meter is not None:
                meter.exit()
        if latency is not None:
            waited = await latency.wait()
            if meter is not None:
                meter.env_wait_s += waited
        return Sample(prompt_ids=list(task.prompt_ids), completion_ids=list(res.output_ids),
                      completion_logprobs=list(res.output_logprobs), token_versions=list(res.token_versions),
                      reward=env.score(task, res.output_ids), finish_reason=res.finish_reason,
                      token_rewards=env.token_rewards(task, res.output_ids) if hasattr(env, "token_rewards") else None,
                      routed_experts=res.routed_experts)

    samples = await asyncio.gather(*(one(i) for i in range(num_samples)))
    return RolloutGroup(group_id=group_id, task_id=task.task_id, samples=list(samples), worker=worker,
                        started_version=started_version)
