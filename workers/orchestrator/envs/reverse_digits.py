"""reverse_digits: reverse a short digit string; reward = fraction of correct positions.

Why this task: a random-init model already earns some reward (a random digit is right
1 time in ``num_symbols``), partial credit gives a dense signal, and reversal needs
attention to the prompt, so a rising reward shows that RL really changes the policy.

Token layout (``vocab_size`` >= 4 + num_symbols):
  PAD=0 BOS=1 SEP=2 EOS=3, digit d -> 4 + d
  prompt     = BOS d1 .. dn SEP
  completion = dn .. d1 EOS   (the engine stops at EOS or after n_max + 1 tokens)
"""
from __future__ import annotations

import dataclasses
import random

from workers.common.config import EnvConfig

PAD, BOS, SEP, EOS = 0, 1, 2, 3
FIRST_DIGIT = 4


@dataclasses.dataclass(frozen=True)
class Task:
    task_id: int
    prompt_ids: tuple[int, ...]
    target_ids: tuple[int, ...]


class ReverseDigitsEnv:
    """Single-turn env: ``sample_task`` -> prompt; ``score`` completion -> reward in [0, 1]."""

    def __init__(self, cfg: EnvConfig, *, seed: int):
        if not 1 <= cfg.min_digits <= cfg.max_digits:
            raise ValueError(f"env.min_digits({cfg.min_digits}) must be in 1..env.max_digits({cfg.max_digits})")
        self.cfg = cfg
        self.rng = random.Random(seed * 1_000_003 + cfg.seed)
        self.next_id = 0
        self.vocab_size = FIRST_DIGIT + cfg.num_symbols
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
