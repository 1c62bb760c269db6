"""The one env protocol the orchestrator drives (episodes.py runs it), for every env.

    env = ENVS.get(cfg.env.name).make(cfg.env, seed=..., model=cfg.model)   # one per orchestrator
    task = env.sample_task()                   # deterministic from the seed; has ``task_id``
    session = env.session(task, episode_id)    # one per episode: scratch state
    prompt_ids = await session.reset()         # first observation = the whole first prompt
    loop (at most env.limits.max_turns turns):
        turn_ids = <generate from history>     # the model's turn, token ids as sampled,
                                               # stopping at env.stop_token_ids
        res = await session.step(turn_ids)     # StepResult(observation_ids, reward, done, info,
                                               #            token_rewards)
        history += turn_ids + res.observation_ids   (only if not res.done)
    reward += await session.final_reward()     # when a limit (turns, tokens, time) or an
                                               # aborted request ended it before ``done``
    await session.close()

Two base classes speak it:
  * :class:`MultiTurnEnv` (code_repair): sessions with tools, a sandbox, several turns;
    ``MultiTurnEnvConfig`` holds the episode limits. Its groups report ``env/<name>/...``
    metrics (``episode_metrics = True``).
  * :class:`SingleTurnEnv` (reverse_digits, reverse_text): a subclass writes ``sample_task``
    (a task with ``prompt_ids``), ``score`` and optionally ``token_rewards``; its sessions end
    at the first step, so an episode is exactly one generate call of ``max_new_tokens`` on the
    task's prompt, scored once. An aborted answer is never shown to the env: it earns 0.

Why sessions: episodes of one group run concurrently and each owns state (a scratch
project, a test-result cache); the env object holds only what episodes share (the task
stream, the sandbox, the env-step concurrency limit). Observations are token ids, not
text, so the env alone decides the chat template and the runner can keep the history an
exact prefix of every next prompt without re-tokenizing anything.
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import sys
import time
from typing import Any, Optional, Protocol

from workers.common.config import EnvConfig
from workers.common.config.ranges import gt, limits, positive


@dataclasses.dataclass(kw_only=True)
class MultiTurnEnvConfig(EnvConfig):
    """Episode limits of multi-turn envs (enforced by the runner, episodes.py)."""

    max_turns: int = 4
    """Most model turns of one episode; the episode is then scored as it stands."""
    max_new_tokens_per_turn: int = 96
    """Generation budget of one model turn (stop token: end of turn)."""
    max_episode_tokens: int = 512
    """Prompt + every turn + every observation of an episode; must fit model.max_position_embeddings."""
    episode_timeout_s: float = 300.0
    """Wall-clock budget of one episode (generation + env steps); past it no new turn starts."""
    max_concurrent_env_steps: int = 2
    """Env steps (sandbox runs) running at once in this env; episodes beyond it wait, generation goes on."""


limits(MultiTurnEnvConfig, max_turns=gt(0), max_new_tokens_per_turn=gt(0), max_episode_tokens=gt(0),
       episode_timeout_s=gt(0), max_concurrent_env_steps=gt(0))


def check_multi_turn(cfg: Any) -> None:
    """Plan-time check of the episode limits (``cfg``: the run config)."""
    e = cfg.env
    for key in ("max_turns", "max_new_tokens_per_turn", "max_episode_tokens", "max_concurrent_env_steps"):
        positive(f"env.{key}", getattr(e, key))
    positive("env.episode_timeout_s", e.episode_timeout_s)
    if e.max_episode_tokens > cfg.model.max_position_embeddings:
        raise ValueError(f"env.max_episode_tokens({e.max_episode_tokens}) > model.max_position_embeddings"
                         f"({cfg.model.max_position_embeddings}): an episode must fit the model's context")
    if e.max_new_tokens_per_turn >= e.max_episode_tokens:
        raise ValueError(f"env.max_new_tokens_per_turn({e.max_new_tokens_per_turn}) must be < env.max_episode_tokens"
                         f"({e.max_episode_tokens}): the prompt needs room too")


@dataclasses.dataclass
class StepResult:
    observation_ids: list[int]
    """Tokens to append after the model's turn (ignored when ``done``)."""
    reward: float = 0.0
    """Reward earned by this step; the episode reward is the sum over steps (+ final_reward)."""
    done: bool = False
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Per-step facts for metrics: ``tool``, ``tool_error``, ``sandbox_timeout``, ``env_s``."""
    token_rewards: Optional[list[float]] = None
    """Optional: the reward of each token of the turn, summing to ``reward`` (reward-to-go
    advantages, orchestrator.advantage=token_rtg); None: one reward for the whole episode."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeLimits:
    """Per-episode limits, enforced by the runner (episodes.py), not by the env."""

    max_turns: int
    max_new_tokens_per_turn: int
    max_episode_tokens: int
    timeout_s: float

    @classmethod
    def from_config(cls, cfg: MultiTurnEnvConfig) -> "EpisodeLimits":
        return cls(max_turns=cfg.max_turns, max_new_tokens_per_turn=cfg.max_new_tokens_per_turn,
                   max_episode_tokens=cfg.max_episode_tokens, timeout_s=cfg.episode_timeout_s)

    @classmethod
    def single_turn(cls, max_new_tokens: int) -> "EpisodeLimits":
        """One turn of ``max_new_tokens``, no token or time budget beyond it."""
        return cls(max_turns=1, max_new_tokens_per_turn=max_new_tokens, max_episode_tokens=sys.maxsize,
                   timeout_s=math.inf)


class EnvSession(Protocol):
    async def reset(self) -> list[int]: ...

    async def step(self, turn_ids: list[int]) -> StepResult: ...

    async def final_reward(self) -> float: ...

    async def close(self) -> None: ...


class Env:
    """What the orchestrator needs of every env (module docstring: the protocol)."""

    name = "env"
    episode_metrics = False
    """Report per-batch ``env/<name>/...`` metrics (turns, env time, finish reasons) for its groups."""
    limits: EpisodeLimits
    stop_token_ids: tuple[int, ...] = ()

    def sample_task(self):
        raise NotImplementedError

    def session(self, task, episode_id: str) -> EnvSession:
        raise NotImplementedError

    def state(self) -> dict:
        """Where the task stream stands (saved in orchestrator_state.json after each batch)."""
        return {}

    def metrics(self) -> dict:
        """Env-level numbers for each batch's metrics record (e.g. the data position)."""
        return {}

    def text(self, ids) -> str:
        """Token ids as text, for sample logs (envs with a tokenizer decode them)."""
        return " ".join(str(int(i)) for i in ids)

    def resolve(self, task) -> tuple["Env", Any]:
        """(the env that runs ``task``, the task it runs): this env itself, except in env=mix
        (envs/mix.py), whose tasks are other envs' tasks."""
        return self, task


EVAL_TASK_IDS = 1_000_000_000
"""Generated eval tasks are numbered from here: their ids never meet the training stream's."""


class GeneratedEvalSplit:
    """An eval split for envs that generate their tasks from ``self.rng`` (reverse_digits,
    reverse_text, code_repair, swe): ``eval_tasks(n)`` draws n tasks from a separate generator seeded
    by ``env.seed`` only, so every evaluation scores the same tasks whatever training has drawn, and
    the training stream (``self.rng``, ``self.next_id``) is left exactly where it was. Unlike a
    held-out file, a small task space (few digits) can repeat a training task: the split measures
    the task, not memorisation."""

    def eval_tasks(self, n: int) -> list:
        import random

        saved = self.rng, self.next_id
        self.rng, self.next_id = random.Random(f"slurmrl-eval-{self.cfg.seed}"), EVAL_TASK_IDS
        try:
            return [self.sample_task() for _ in range(n)]
        finally:
            self.rng, self.next_id = saved


class MultiTurnEnv(Env):
    """Base class of multi-turn envs: task stream, stop tokens, limits, env-step slots."""

    name = "multi_turn"
    episode_metrics = True

    def __init__(self, cfg: MultiTurnEnvConfig, *, seed: int):
        self.cfg = cfg
        self.seed = seed
        self.limits = EpisodeLimits.from_config(cfg)
        self.max_new_tokens = cfg.max_new_tokens_per_turn
        self._slots: Optional[asyncio.Semaphore] = None
        self.stop_token_ids: tuple[int, ...] = ()

    @property
    def step_slots(self) -> asyncio.Semaphore:
        """At most ``max_concurrent_env_steps`` env steps at once (created in the running loop)."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(max(1, self.cfg.max_concurrent_env_steps))
        return self._slots


class SingleTurnEnv(Env):
    """Base class of single-turn envs: one answer to ``task.prompt_ids``, scored by ``score``.

    A subclass sets ``max_new_tokens`` and ``stop_token_ids`` and writes ``sample_task`` and
    ``score`` (and ``token_rewards`` for per-token credit)."""

    max_new_tokens: int

    @property
    def limits(self) -> EpisodeLimits:
        return EpisodeLimits.single_turn(self.max_new_tokens)

    def score(self, task, completion_ids: list[int]) -> float:
        raise NotImplementedError

    def token_rewards(self, task, completion_ids: list[int]) -> Optional[list[float]]:
        """Reward of each completion token (summing to ``score``); None: only the total."""
        return None

    def session(self, task, episode_id: str) -> "SingleTurnSession":
        return SingleTurnSession(self, task)


class SingleTurnSession:
    """Prompt = the task's prompt; the first step scores the answer and ends the episode."""

    def __init__(self, env: SingleTurnEnv, task):
        self.env, self.task = env, task

    async def reset(self) -> list[int]:
        return list(self.task.prompt_ids)

    async def step(self, turn_ids: list[int]) -> StepResult:
        return StepResult(observation_ids=[], reward=self.env.score(self.task, turn_ids), done=True,
                          token_rewards=self.env.token_rewards(self.task, turn_ids))

    async def final_reward(self) -> float:
        return 0.0  # no answer was scored (the request was aborted)

    async def close(self) -> None:
        pass


class Stopwatch:
    """Accumulates seconds spent inside ``with`` blocks (env time of one episode)."""

    def __init__(self):
        self.total = 0.0

    def __enter__(self) -> "Stopwatch":
        self._t0 = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        self.total += time.monotonic() - self._t0
