"""Evaluation during training and sample logging, for the orchestrator's loop (loop.py).

Evaluation (``orchestrator.eval_every_steps`` = k > 0, ``eval_num_samples`` = n)::

    after a weight update to version v (and once on the initial weights):
        if no eval is running and v >= last evaluated version + k:
            start one eval task: episodes on the env's first n eval records (one greedy answer
            each, or ``eval_k`` sampled ones), through the same inference workers and episode
            runner as rollouts
    when a batch is written: a finished eval's metrics go into that batch's record
        (eval/reward, eval/pass@1, eval/pass@<eval_k>, eval/num_samples, eval/weights_step, eval/policy_version,
         eval/reward_failures, eval/aborted, eval/reward/<name> for named rewards)

Why inside the batch record: metrics.jsonl and TensorBoard are the trainer's (one record per
step), so eval rows land in the same files with the same step numbering, without a second
writer. ``eval/weights_step`` says which weights were evaluated (the version the eval started on:
weights after that trainer step; ``eval/policy_version`` is the oldest version any of its tokens
came from); the record's ``step`` says when it was reported. The console prints an eval on its own
line labelled with ``eval/weights_step``, and TensorBoard logs ``eval/*`` at that step. The eval task runs
beside rollouts (no stall); a worker that fails mid-eval loses that eval (logged), not the run.

Sample logging (``orchestrator.log_samples_every_steps``): ``orchestrator.num_logged_samples`` samples
of a batch, spread over its rewards from the best to the worst, as text (decoded by the env's
``text``) in the orchestrator log and, through the batch's record, in metrics.jsonl (``samples``:
[{reward, prompt, completion}]), TensorBoard (text) and W&B (a table) at that step.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

import numpy as np

from workers.common.inference_client import InferenceError
from workers.orchestrator.adapters import client_for
from workers.orchestrator.buffer import RolloutGroup, Sample
from workers.orchestrator.episodes import run_episode

GREEDY = 0.0
MAX_LOGGED_CHARS = 400


def reward_metrics(samples: list[Sample], prefix: str = "") -> dict[str, Any]:
    """Reward failures (timeouts, exceptions, non-numbers; envs/dataset.py) and the mean of each
    named reward of ``samples``; keys absent for envs that report neither."""
    infos = [s.env_info or {} for s in samples]
    out: dict[str, Any] = {}
    if any("reward_failures" in i for i in infos):
        failures = int(sum(i.get("reward_failures", 0) for i in infos))
        calls = int(sum(i.get("reward_calls", 1) for i in infos))
        out[prefix + "reward_failures"] = failures
        out[prefix + "reward_timeouts"] = int(sum(i.get("reward_timeouts", 0) for i in infos))
        out[prefix + "reward_calls"] = calls
        out[prefix + "reward_failure_frac"] = failures / max(calls, 1)
    names = sorted({k for i in infos for k in i if k.startswith("reward/")})
    for name in names:
        out[prefix + name] = float(np.mean([i.get(name, 0.0) for i in infos]))
    return out


def _short(text: str) -> str:
    """One log line: control characters escaped (an untrained model emits any byte), long text cut."""
    text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)
    return text if len(text) <= MAX_LOGGED_CHARS else text[:MAX_LOGGED_CHARS] + "..."


def describe(env, sample: Sample) -> str:
    """One sample as text: prompt, completion and reward."""
    return (f"reward {sample.reward:.3f} | prompt: {_short(env.text(sample.prompt_ids))} | "
            f"completion: {_short(env.text(sample.completion_ids))}")


def pick_samples(samples: list[Sample], n: int) -> list[tuple[str, Sample]]:
    """``n`` samples at evenly spaced reward ranks, best first, labelled ``best`` / ``rank k`` / ``worst``."""
    ranked = sorted(samples, key=lambda s: -s.reward)
    n = min(n, len(ranked))
    if n == 0:
        return []
    at = [0] if n == 1 else sorted({round(i * (len(ranked) - 1) / (n - 1)) for i in range(n)})
    return [("best" if i == 0 else "worst" if i == len(ranked) - 1 else f"rank {i + 1}", ranked[i]) for i in at]


def log_samples(log: logging.Logger, env, step: int, groups: list[RolloutGroup], num: int = 2) -> list[dict]:
    """Log ``num`` of the batch's samples as text; returns them as rows for the step's record."""
    rows = []
    for label, s in pick_samples([s for g in groups for s in g.samples], num):
        log.info("step %d sample (%s): %s", step, label, describe(env, s))
        rows.append({"rank": label, "reward": float(s.reward), "prompt": _short(env.text(s.prompt_ids)),
                     "completion": _short(env.text(s.completion_ids))})
    return rows


class Evaluator:
    """At most one eval in flight; its metrics wait for the next batch (module docstring)."""

    def __init__(self, env, *, every: int, num_samples: int, log: logging.Logger, k: int = 1,
                 temperature: float = 1.0, success_reward: float = 1.0, adapters: tuple = ()):
        self.env, self.every, self.num_samples, self.log = env, every, num_samples, log
        self.adapters = adapters  # several LoRA adapters: each eval task is sampled with its own (adapters.py)
        self.k, self.success_reward = k, success_reward
        self.temperature = GREEDY if k == 1 else temperature
        self.last_version: Optional[int] = None
        self.task: Optional[asyncio.Task] = None
        self.num_evals = 0

    def maybe_start(self, client, version: int) -> None:
        if self.every <= 0 or self.task is not None:
            return
        if self.last_version is not None and version < self.last_version + self.every:
            return
        self.last_version = version
        self.task = asyncio.create_task(self.run(client, version))

    async def run(self, client, version: int) -> dict[str, Any]:
        tasks = self.env.eval_tasks(self.num_samples)
        samples: list[Sample] = await asyncio.gather(*(
            run_episode(client_for(client, t, self.adapters), *self.env.resolve(t), episode_id=f"eval-v{version}-{i}-{j}",
                        temperature=self.temperature, return_routed_experts=False)
            for i, t in enumerate(tasks) for j in range(self.k)))
        answered = [s for s in samples if s.finish_reason != "abort"]
        versions = [v for s in answered for v in s.token_versions if v >= 0]
        out = {"eval/reward": float(np.mean([s.reward for s in answered])) if answered else float("nan"),
               "eval/num_samples": len(answered), "eval/aborted": len(samples) - len(answered),
               "eval/policy_version": min(versions) if versions else version,
               "eval/weights_step": version,  # the step whose weights were evaluated (version v = after step v)
               **self.pass_at_k(samples), **reward_metrics(answered, prefix="eval/")}
        labels = [getattr(t, "label", None) for t in tasks for _ in range(self.k)]
        for label in sorted({lb for lb in labels if lb is not None}):  # env=mix: per entry too
            mine = [s for s, lb in zip(samples, labels) if lb == label and s.finish_reason != "abort"]
            out[f"eval/{label}/reward"] = float(np.mean([s.reward for s in mine])) if mine else float("nan")
        if answered:
            self.log.info("eval at weights %d: reward %.3f over %d samples; first: %s", out["eval/policy_version"],
                          out["eval/reward"], len(answered), describe(self.env, answered[0]))
        return out

    def pass_at_k(self, samples: list[Sample]) -> dict[str, float]:
        """pass@1: the fraction of answers that succeed; pass@k (k > 1): the fraction of records with
        at least one success among its k answers (samples are grouped k per record, in order).
        An aborted answer counts as a failure."""
        ok = [s.finish_reason != "abort" and s.reward >= self.success_reward for s in samples]
        if not ok:
            return {}
        out = {"eval/pass@1": float(np.mean(ok))}
        if self.k > 1:
            out[f"eval/pass@{self.k}"] = float(np.mean([any(ok[i: i + self.k]) for i in range(0, len(ok), self.k)]))
        return out

    def take_result(self) -> dict[str, Any]:
        """A finished eval's metrics (once), else {}."""
        if self.task is None or not self.task.done():
            return {}
        task, self.task = self.task, None
        try:
            result = task.result()
        except (InferenceError, asyncio.CancelledError) as e:
            self.log.warning("eval at weights %s lost: %s", self.last_version, e or "cancelled")
            return {}
        except Exception as e:  # an eval must never stop training; the error is shown
            self.log.error("eval at weights %s failed: %s: %s", self.last_version, type(e).__name__, e)
            return {}
        self.num_evals += 1
        return result

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
