"""reverse_digits: reverse a short digit string; reward = fraction of correct positions.

Why this task: a random-init model already earns some reward (a random digit is right
1 time in ``num_symbols``), partial credit gives a dense signal, and reversal needs
attention to the prompt, so a rising reward shows that RL really changes the policy.

Token layout (``vocab_size`` >= 4 + num_symbols):
  PAD=0 BOS=1 SEP=2 EOS=3, digit d -> 4 + d
  prompt     = BOS d1 .. dn SEP
  completion = dn .. d1 EOS   (the engine stops at EOS or after n_max + 1 tokens)

This module is the env's whole home: its config (the schema of ``env=reverse_digits``), its
plan check, its vocabulary (``vocab_size``) and the env; the spec is registered at the bottom.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any

from workers.common.config import EnvConfig
from workers.common.config.ranges import gt, limits, positive
from workers.common.registry import ENVS
from workers.orchestrator.envs.base import GeneratedEvalSplit, SingleTurnEnv
from workers.orchestrator.envs.spec import EnvSpec

PAD, BOS, SEP, EOS = 0, 1, 2, 3
FIRST_DIGIT = 4


@dataclasses.dataclass(kw_only=True)
class ReverseDigitsConfig(EnvConfig):
    name: str = "reverse_digits"
    """Task name."""
    min_digits: int = 3
    """Shortest digit string of a prompt."""
    max_digits: int = 4
    """Longest digit string of a prompt."""
    num_symbols: int = 10
    """Distinct digit symbols (0..num_symbols-1)."""


limits(ReverseDigitsConfig, min_digits=gt(0), max_digits=gt(0), num_symbols=gt(0))


def vocab_size(cfg: ReverseDigitsConfig) -> int:
    """PAD BOS SEP EOS + one token per digit symbol."""
    return FIRST_DIGIT + cfg.num_symbols


def check(run_cfg: Any) -> None:
    e = run_cfg.env
    positive("env.min_digits", e.min_digits)
    if e.max_digits < e.min_digits:
        raise ValueError(f"env.max_digits({e.max_digits}) must be >= env.min_digits({e.min_digits})")
    positive("env.num_symbols", e.num_symbols)
    longest = 2 + e.max_digits + e.max_digits + 1
    if longest > run_cfg.model.max_position_embeddings:
        raise ValueError(f"model.max_position_embeddings({run_cfg.model.max_position_embeddings}) < longest episode "
                         f"({longest} tokens for env.max_digits={e.max_digits})")


@dataclasses.dataclass(frozen=True)
class Task:
    task_id: int
    prompt_ids: tuple[int, ...]
    target_ids: tuple[int, ...]


class ReverseDigitsEnv(GeneratedEvalSplit, SingleTurnEnv):
    """Single-turn env: ``sample_task`` -> prompt; ``score`` completion -> reward in [0, 1]."""

    name = "reverse_digits"

    def __init__(self, cfg: ReverseDigitsConfig, *, seed: int):
        if not 1 <= cfg.min_digits <= cfg.max_digits:
            raise ValueError(f"env.min_digits({cfg.min_digits}) must be in 1..env.max_digits({cfg.max_digits})")
        self.cfg = cfg
        self.rng = random.Random(seed * 1_000_003 + cfg.seed)
        self.next_id = 0
        self.vocab_size = vocab_size(cfg)
        self.max_new_tokens = cfg.max_digits + 1
        self.stop_token_ids = (EOS,)

    def sample_task(self) -> Task:
        n = self.rng.randint(self.cfg.min_digits, self.cfg.max_digits)
        digits = [FIRST_DIGIT + self.rng.randrange(self.cfg.num_symbols) for _ in range(n)]
        self.next_id += 1
        return Task(self.next_id, (BOS, *digits, SEP), tuple(reversed(digits)))

    def score(self, task: Task, completion_ids: list[int]) -> float:
        return sum(self.token_rewards(task, completion_ids))

    def token_rewards(self, task: Task, completion_ids: list[int]) -> list[float]:
        """Reward earned by each completion token; they sum exactly to the episode reward.

        Episode reward = correct / max(n, a) (n target digits, a answer tokens before EOS).
        Position j < n earns 1/n when right; when the answer rambles past n tokens, the
        loss this causes (c/n - c/a) is charged to the extra tokens only, so reward-to-go
        advantages blame the tokens that rambled, not the correct ones before them.
        """
        answer = list(completion_ids)
        if answer and answer[-1] == EOS:
            answer = answer[:-1]
        target, n, a = task.target_ids, len(task.target_ids), len(answer)
        rewards = [1.0 / n if j < a and j < n and answer[j] == target[j] else 0.0 for j in range(len(completion_ids))]
        if a > n:
            correct = sum(rewards[:n]) * n
            penalty = (correct / n - correct / a) / (a - n)
            for j in range(n, a):
                rewards[j] = -penalty
        return rewards

    def state(self) -> dict:
        return {"next_id": self.next_id, "rng": repr(self.rng.getstate())}


ENVS.register(EnvSpec(name="reverse_digits", config=ReverseDigitsConfig, vocab_size=vocab_size, env_check=check, eval_split=True,
                      make=lambda cfg, *, seed, model=None: ReverseDigitsEnv(cfg, seed=seed),
                      summary="reverse a digit string; per-token partial credit"))
