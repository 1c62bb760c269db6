"""An environment of your own, outside the project (docs/guide/bring_your_own.md).

    PYTHONPATH=$PWD/docs/examples/own_env slurmrl "hydra.searchpath=[file://$PWD/docs/examples/own_env/conf]" \
        env=first_digit orchestrator.log_samples_every_steps=1

The task: the prompt is ``BOS d1 d2 .. dn SEP`` (digit tokens 4..13); the answer is d1, then EOS.
It brings its own 14-token vocabulary (``vocab_size``), which the tiny model (vocab 16) covers.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from workers.orchestrator.envs.base import SingleTurnEnv

BOS, SEP, EOS, FIRST_DIGIT = 1, 2, 3, 4


@dataclass(frozen=True)
class Task:
    task_id: int
    prompt_ids: tuple[int, ...]
    target: int


class FirstDigit(SingleTurnEnv):
    vocab_size = FIRST_DIGIT + 10  # its own token ids 0..13 (None: the model's tokenizer)

    def __init__(self, *, seed: int, length: int = 3):
        self.rng, self.length, self.drawn = random.Random(seed), length, 0
        self.max_new_tokens, self.stop_token_ids = 2, (EOS,)

    def sample_task(self) -> Task:
        digits = [FIRST_DIGIT + self.rng.randrange(10) for _ in range(self.length)]
        self.drawn += 1
        return Task(self.drawn, (BOS, *digits, SEP), digits[0])

    def score(self, task: Task, completion_ids: list[int]) -> float:
        return float(bool(completion_ids) and completion_ids[0] == task.target)

    def state(self) -> dict:
        return {"drawn": self.drawn}
