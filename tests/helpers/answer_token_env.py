"""A test env for several LoRA adapters in one run (tests/integration/test_lora_adapters_run.py):
answer with one digit of a given parity. Two entries with opposite parities are two CONFLICTING
tasks on the same prompts: one shared policy puts probability p on even digits and q on odd ones
with p + q <= 1, so both entries' rewards well above 1/2 at once prove that each adapter learned its
own task. Each parity is about 5/16 of a random model's first token: a dense signal from step 1."""
from __future__ import annotations

import random
from dataclasses import dataclass

from workers.orchestrator.envs.base import SingleTurnEnv

FIRST_DIGIT, NUM_DIGITS = 4, 10


@dataclass(frozen=True)
class Task:
    task_id: int
    prompt_ids: tuple


class AnswerParity(SingleTurnEnv):
    """Prompt BOS d1 d2 d3 SEP (digit ids 4..13); reward 1 when the answer is a digit of ``parity``."""
    vocab_size = 14

    def __init__(self, *, seed, parity=0):
        self.rng, self.parity, self.n = random.Random(seed), int(parity), 0
        self.max_new_tokens, self.stop_token_ids = 1, (3,)

    def sample_task(self):
        self.n += 1
        return Task(self.n, (1, *(FIRST_DIGIT + self.rng.randrange(NUM_DIGITS) for _ in range(3)), 2))

    def score(self, task, completion_ids):
        d = completion_ids[0] - FIRST_DIGIT if completion_ids else -1
        return float(0 <= d < NUM_DIGITS and d % 2 == self.parity)
