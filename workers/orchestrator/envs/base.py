"""The multi-turn environment interface the orchestrator drives (episodes.py runs it).

    env = make_env(cfg.env, seed=...)          # one per orchestrator: task stream, shared limits
    task = env.sample_task()                   # deterministic from the seed
    session = env.session(task, episode_id)    # one per episode: scratch state
    prompt_ids = await session.reset()         # first observation = the whole first prompt
    loop:
        turn_ids = <generate from history>     # the model's turn, token ids as sampled
        res = await session.step(turn_ids)     # StepResult(observation_ids, reward, done, info)
        history += turn_ids + res.observation_ids   (only if not res.done)
    reward += await session.final_reward()     # when a limit (turns, tokens, time) ended it early
    await session.close()

Why sessions: episodes of one group run concurrently and each owns state (a scratch
project, a test-result cache); the env object holds only what episodes share (the task
stream, the sandbox, the env-step concurrency limit). Observations are token ids, not
text, so the env alone decides the chat template and the runner can keep the history an
exact prefix of every next prompt without re-tokenizing anything.

Single-turn envs (reverse_digits: ``sample_task`` + ``score``) keep their own path in
rollouts.run_group; ``is_multi_turn`` tells the loop which one to use.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Optional, Protocol

from workers.common.config import EnvConfig


@dataclasses.dataclass
class StepResult:
    observation_ids: list[int]
    """Tokens to append after the model's turn (ignored when ``done``)."""
    reward: float = 0.0
    """Reward earned by this step; the episode reward is the sum over steps (+ final_reward)."""
    done: bool = False
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Per-step facts for metrics: ``tool``, ``tool_error``, ``sandbox_timeout``, ``env_s``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeLimits:
    """Per-episode limits, enforced by the runner (episodes.py), not by the env."""

    max_turns: int
    max_new_tokens_per_turn: int
    max_episode_tokens: int
    timeout_s: float

    @classmethod
    def from_config(cls, cfg: EnvConfig) -> "EpisodeLimits":
        return cls(max_turns=cfg.max_turns, max_new_tokens_per_turn=cfg.max_new_tokens_per_turn,
                   max_episode_tokens=cfg.max_episode_tokens, timeout_s=cfg.episode_timeout_s)


class EnvSession(Protocol):
    async def reset(self) -> list[int]: ...

    async def step(self, turn_ids: list[int]) -> StepResult: ...

    async def final_reward(self) -> float: ...

    async def close(self) -> None: ...


class MultiTurnEnv:
    """Base class of multi-turn envs: task stream, stop tokens, limits, env-step slots."""

    name = "multi_turn"
    is_multi_turn = True

    def __init__(self, cfg: EnvConfig, *, seed: int):
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

    def sample_task(self):
        raise NotImplementedError

    def session(self, task, episode_id: str) -> EnvSession:
        raise NotImplementedError

    def state(self) -> dict:
        return {}


def is_multi_turn(env: Any) -> bool:
    return bool(getattr(env, "is_multi_turn", False))


class Stopwatch:
    """Accumulates seconds spent inside ``with`` blocks (env time of one episode)."""

    def __init__(self):
        self.total = 0.0

    def __enter__(self) -> "Stopwatch":
        self._t0 = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        self.total += time.monotonic() - self._t0
