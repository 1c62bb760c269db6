"""Rollouts: run episodes of any env (envs/base.py protocol) against an inference worker.

Every env goes through here: a single-turn env (reverse_digits) is an episode of one turn
whose step scores the answer, so its sample is prompt + answer with the env's reward (and its
per-token rewards, for orchestrator.advantage=token_rtg), exactly one generate call.

One episode (``run_episode``)::

    history = await session.reset()                      # first prompt
    until done or a limit (turns, tokens, wall time):
        out = generate(history)                          # the model's turn
        history += out.ids;  sample += out.ids (loss 1, logprobs, versions, routed rows)
        res = await session.step(out.ids)                # tools, sandbox: may take long
        next turn: history += res.observation_ids;  sample += them (loss 0, version -1)
    reward = sum of step rewards (+ final_reward() when a limit ended it)
    token_rewards = each turn's step.token_rewards (0 on env tokens), when every step gave them

Invariants the trainer relies on (tests/unit/orchestrator/test_envs_episodes.py checks each):
  * every generate call's input is the previous call's input + its output + the new
    observation, token for token (nothing is re-tokenized), and the sample's tokens are
    the last call's input + output; an observation after the last turn is not kept;
  * ``completion_mask`` is 1 exactly on model-sampled tokens; logprobs and versions sit on
    the same positions (0.0 / -1 on env tokens);
  * routed rows: row t = experts used when token t was the input. Turn k's response
    covers rows [0, len(history) - 1); rows already taken from earlier turns are kept (they
    are what the sampled logprobs saw) and the new ones appended, so the sample has
    exactly len(tokens) - 1 rows and the observation tokens' rows are the engine's own.

Why no head-of-line blocking: each episode is its own coroutine; while one awaits its
sandbox (bounded by the env's ``step_slots``), others keep generating, and the loop
admits new groups as old ones finish (plus ``orchestrator.num_spare_groups``).
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any, Optional

import numpy as np

from workers.common.inference_client import InferenceClient
from workers.orchestrator.buffer import RolloutGroup, Sample
from workers.orchestrator.envs.base import Stopwatch


async def run_episode(client: InferenceClient, env, task, *, episode_id: str, temperature: float,
                      return_routed_experts: bool, meter=None, latency=None) -> Sample:
    """One episode as one training Sample (prompt = first observation, completion = the rest).

    ``latency`` (envs.latency.LatencyModel, env.latency=...) adds a simulated heavy-tailed wait
    to every env step, counted as env time: long-tail tools without a real slow tool.
    Per-token rewards: each step's ``token_rewards`` on its turn's tokens, 0 on env tokens and on
    a turn no step saw, ``final_reward`` on the last token; None once a step gives none.
    """
    limits = env.limits
    session = env.session(task, episode_id)
    watch = Stopwatch()
    t0 = time.monotonic()
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    routed: Optional[list[np.ndarray]] = [] if return_routed_experts else None
    token_rewards: Optional[list[float]] = []  # parallel to ids while every step gives per-token rewards
    num_routed, reward, turns, finish = 0, 0.0, 0, "max_turns"
    infos: list[dict] = []
    try:
        with watch:
            prompt = list(await session.reset())
        history, pending = list(prompt), []
        while True:
            if turns >= limits.max_turns:
                break
            budget = limits.max_episode_tokens - len(history) - len(pending)
            if budget < 1:
                finish = "max_tokens"
                break
            if time.monotonic() - t0 > limits.timeout_s:
                finish = "timeout"
                break
            ids += pending
            mask += [0] * len(pending)
            logprobs += [0.0] * len(pending)
            versions += [-1] * len(pending)
            if token_rewards is not None:
                token_rewards += [0.0] * len(pending)
            history += pending
            res = await _generate(client, history, env, temperature=temperature,
                                  max_new_tokens=min(limits.max_new_tokens_per_turn, budget),
                                  routed=return_routed_experts, rid=f"{episode_id}-t{turns}", meter=meter)
            turn = list(res.output_ids)
            ids += turn
            mask += [1] * len(turn)
            logprobs += list(res.output_logprobs)
            versions += list(res.token_versions)
            if token_rewards is not None:
                token_rewards += [0.0] * len(turn)
            history += turn
            turns += 1
            if routed is not None:
                if res.routed_experts is None:
                    routed = None  # an aborted request reported no routing: the sample has none
                else:
                    routed.append(res.routed_experts[num_routed: len(history) - 1])
                    num_routed = len(history) - 1
            if res.finish_reason == "abort":
                finish = "abort"
                break
            with watch:
                step = await session.step(turn)
                if latency is not None:
                    waited = await latency.wait()
                    if meter is not None:
                        meter.env_wait_s += waited
            reward += step.reward
            if token_rewards is not None and step.token_rewards is not None and len(step.token_rewards) == len(turn):
                token_rewards[len(token_rewards) - len(turn):] = [float(r) for r in step.token_rewards]
            else:
                token_rewards = None
            infos.append(step.info)
            if step.done:
                finish = "done"
                break
            pending = list(step.observation_ids)
        if finish != "done":
            with watch:
                final = await session.final_reward()
            reward += final
            if token_rewards is not None and final:
                if token_rewards:
                    token_rewards[-1] += final
                else:
                    token_rewards = None
    finally:
        await session.close()
    info = {"turns": turns, "env_s": watch.total, "episode_s": time.monotonic() - t0, "finish": finish,
            "model_tokens": sum(mask), "episode_tokens": len(prompt) + len(ids),
            "tool_errors": sum(int(i.get("tool_error", 0)) for i in infos),
            **{k: v for k, v in getattr(session, "metrics", {}).items() if k not in ("env_s", "tool_errors")}}
    return Sample(prompt_ids=prompt, completion_ids=ids, completion_logprobs=logprobs, token_versions=versions,
                  reward=float(reward), finish_reason=finish, completion_mask=mask, env_info=info,
                  token_rewards=token_rewards, routed_experts=np.concatenate(routed) if routed else None)


async def _generate(client: InferenceClient, history: list[int], env, *, temperature: float, max_new_tokens: int,
                    routed: bool, rid: str, meter):
    if meter is not None:
        meter.enter()
    try:
        return await client.generate(list(history), temperature=temperature, max_new_tokens=max_new_tokens,
                                     stop_token_ids=list(env.stop_token_ids), return_routed_experts=routed, rid=rid)
    finally:
        if meter is not None:
            meter.exit()


async def run_episode_group(client: InferenceClient, env, task, *, group_id: int, worker: int, num_samples: int,
                            temperature: float, return_routed_experts: bool, started_version: int,
                            meter=None, latency=None, env_tag: Optional[str] = None) -> RolloutGroup:
    """``num_samples`` concurrent episodes of one task on one worker (one group: advantages are
    relative to it; sticky: the samples share the prompt's prefix cache). ``meter`` records when
    inference had work. Envs with ``episode_metrics`` tag the group for env_batch_metrics, under
    their name or ``env_tag`` (env=mix: the entry's label, given for every entry)."""
    samples = await asyncio.gather(*(
        run_episode(client, env, task, episode_id=f"g{group_id}-s{i}", temperature=temperature,
                    return_routed_experts=return_routed_experts, meter=meter, latency=latency)
        for i in range(num_samples)))
    return RolloutGroup(group_id=group_id, task_id=task.task_id, samples=list(samples), worker=worker,
                        started_version=started_version,
                        env_metrics={"env": env_tag or env.name} if env.episode_metrics or env_tag else {})


def env_batch_metrics(groups: list[RolloutGroup]) -> dict[str, Any]:
    """Per-env metrics of one batch, keyed ``env/<name>/<metric>`` (groups of envs with ``episode_metrics``)."""
    by_env: dict[str, list[Sample]] = {}
    for g in groups:
        if "env" in g.env_metrics:
            by_env.setdefault(g.env_metrics["env"], []).extend(s for s in g.samples if s.env_info)
    out: dict[str, Any] = {}
    for name, samples in by_env.items():
        if not samples:
            continue
        p = f"env/{name}/"
        col = lambda key: np.array([float(s.env_info.get(key, 0)) for s in samples])  # noqa: E731
        turns = col("turns")
        out.update({
            p + "episode_turns_mean": float(turns.mean()), p + "episode_turns_max": int(turns.max()),
            p + "env_time_s_mean": float(col("env_s").mean()), p + "env_time_s_max": float(col("env_s").max()),
            p + "episode_time_s_max": float(col("episode_s").max()),
            p + "episode_tokens_max": int(col("episode_tokens").max()),
            p + "model_tokens_frac": float(col("model_tokens").sum() / max(col("episode_tokens").sum(), 1)),
            p + "sandbox_runs": int(col("sandbox_runs").sum()), p + "sandbox_timeouts": int(col("sandbox_timeouts").sum()),
            p + "tool_errors_per_turn": float(col("tool_errors").sum() / max(turns.sum(), 1)),
            p + "reward_mean": float(np.mean([s.reward for s in samples])),
        })
        modes = sorted({s.env_info["sandbox_mode"] for s in samples if "sandbox_mode" in s.env_info})
        if modes:
            out[p + "sandbox_mode"] = ",".join(modes)
        finishes = Counter(s.env_info.get("finish", "?") for s in samples)
        for reason, n in sorted(finishes.items()):
            out[p + f"finish_{reason}_frac"] = n / len(samples)
    return out
