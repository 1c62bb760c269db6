"""Test-only environment ``count_up``, registered from the test tree (no project file names it).

    SLURMRL_PLUGINS=tests.plugins.envs_plugin slurmrl env=count_up

Task: the prompt is a run of consecutive digits (mod 10), ``BOS d d+1 .. d+n-1 SEP``; the model
must continue it with the next ``env.count`` digits and stop (EOS). Reward = fraction of the
``count`` positions continued correctly, given per token (token_rtg works with it), so a random
policy earns ~0.1 and learning shows. It is a :class:`SingleTurnEnv` with a config of its own
(``count``, the one field the base ``EnvConfig`` lacks), a plan check and a vocabulary of 14
ids, which the tiny model (vocab 16) covers.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any

from workers.common.config import EnvConfig
from workers.common.registry import ENVS
from workers.orchestrator.envs.base import SingleTurnEnv
from workers.orchestrator.envs.spec import EnvSpec, positive

PAD, BOS, SEP, EOS = 0, 1, 2, 3
FIRST_DIGIT, NUM_DIGITS = 4, 10
PROMPT_DIGITS = (2, 4)  # shortest and longest run shown


@dataclasses.dataclass(kw_only=True)
class CountUpConfig(EnvConfig):
    name: str = "count_up"
    """Task name."""
    count: int = 3
    """Digits the model must add to the run shown in the prompt."""


@dataclasses.dataclass(frozen=True)
class Task:
    task_id: int
    prompt_ids: tuple[int, ...]
    target_ids: tuple[int, ...]


def check(run_cfg: Any) -> None:
    positive("env.count", run_cfg.env.count)
    longest = 2 + PROMPT_DIGITS[1] + run_cfg.env.count + 1
    if longest > run_cfg.model.max_position_embeddings:
        raise ValueError(f"env.count({run_cfg.env.count}): episodes of {longest} tokens exceed "
                         f"model.max_position_embeddings({run_cfg.model.max_position_embeddings})")


class CountUpEnv(SingleTurnEnv):
    name = "count_up"

    def __init__(self, cfg: CountUpConfig, *, seed: int):
        self.cfg = cfg
        self.rng = random.Random(seed * 1_000_003 + cfg.seed)
        self.next_id = 0
        self.max_new_tokens = cfg.count + 1
        self.stop_token_ids = (EOS,)

    def sample_task(self) -> Task:
        start, n = self.rng.randrange(NUM_DIGITS), self.rng.randint(*PROMPT_DIGITS)
        digits = [FIRST_DIGIT + (start + i) % NUM_DIGITS for i in range(n + self.cfg.count)]
        self.next_id += 1
        return Task(self.next_id, (BOS, *digits[:n], SEP), tuple(digits[n:]))

    def token_rewards(self, task: Task, completion_ids: list[int]) -> list[float]:
        k = len(task.target_ids)
        return [1.0 / k if j < k and t == task.target_ids[j] else 0.0 for j, t in enumerate(completion_ids)]

    def score(self, task: Task, completion_ids: list[int]) -> float:
        return sum(self.token_rewards(task, completion_ids))

    def state(self) -> dict:
        return {"next_id": self.next_id}


SPEC = ENVS.register(EnvSpec(name="count_up", config=CountUpConfig, env_check=check,
                             vocab_size=lambda cfg: FIRST_DIGIT + NUM_DIGITS,
                             make=lambda cfg, *, seed, model=None: CountUpEnv(cfg, seed=seed),
                             summary="test only: continue a run of digits"), replace=True)
