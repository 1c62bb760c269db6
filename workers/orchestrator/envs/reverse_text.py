"""reverse_text: reverse the order of the words of a short text; reward = character similarity.

For a pretrained chat model (model.pretrained, e.g. SmolLM2-135M-Instruct): the prompt is
built with the model's OWN tokenizer and chat template, so the task reads like any chat
request, and the answer is decoded back to text before it is scored.

Why word order and not characters: a 135M model sees text as sub-word tokens, so reversing
the letters of a word asks it to spell tokens it never saw spelled; reversing the order of a
few common words is the same kind of verifiable "reverse a short text" task, one the model
can already do sometimes, which is what RL needs (reward variance within a group).

Reward: ``difflib.SequenceMatcher(answer, target).ratio()`` = 2 * matched characters /
(len(answer) + len(target)), in [0, 1]: partial credit for partly right orders, and chatter
around the answer lowers it (the denominator grows), so "answer only" is learned too.
"""
from __future__ import annotations

import dataclasses
import difflib
import random

from workers.common.config import EnvConfig
from workers.common.pretrained import require_prepared

#: Common short English words (each a single token or two for a Llama-style BPE).
WORDS = ("apple", "river", "stone", "cloud", "green", "music", "light", "table", "paper", "dream", "house",
         "water", "horse", "bread", "chair", "night", "smile", "glass", "tiger", "ocean", "money", "plant",
         "train", "watch", "sugar", "beach", "phone", "heart", "storm", "field", "piano", "lemon", "candle",
         "winter", "garden", "silver", "window", "forest", "rocket", "yellow")
PROMPT = "Reverse the order of these words: {text}\nAnswer with the reversed words only."


@dataclasses.dataclass(frozen=True)
class Task:
    task_id: int
    prompt_ids: tuple[int, ...]
    text: str
    target: str


def similarity(answer: str, target: str) -> float:
    """Character-level similarity in [0, 1] (1: identical)."""
    return difflib.SequenceMatcher(None, answer, target, autojunk=False).ratio()


class ReverseTextEnv:
    """Single-turn env over a pretrained model's tokenizer: ``sample_task`` -> chat prompt ids;
    ``score`` decodes the completion and compares it with the reversed text."""

    name = "reverse_text"

    def __init__(self, cfg: EnvConfig, *, seed: int, model=None, tokenizer=None):
        if not 1 <= cfg.min_words <= cfg.max_words <= len(WORDS):
            raise ValueError(f"need 1 <= env.min_words({cfg.min_words}) <= env.max_words({cfg.max_words}) "
                             f"<= {len(WORDS)} (the word list)")
        if tokenizer is None:
            if model is None or not model.pretrained:
                raise ValueError("env=reverse_text needs a pretrained model's tokenizer: set model.pretrained "
                                 "(e.g. model=smollm2_135m)")
            from workers.modeling.convert import load_tokenizer  # transformers: only this env needs it

            tokenizer = load_tokenizer(require_prepared(model))
        self.cfg, self.tokenizer = cfg, tokenizer
        self.rng = random.Random(seed * 1_000_003 + cfg.seed)
        self.next_id = 0
        self.max_new_tokens = cfg.max_new_tokens
        self.stop_token_ids = (int(tokenizer.eos_token_id),)

    def prompt_ids(self, text: str) -> list[int]:
        messages = [{"role": "user", "content": PROMPT.format(text=text)}]
        if self.cfg.system_prompt:
            messages.insert(0, {"role": "system", "content": self.cfg.system_prompt})
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # some transformers versions return a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def sample_task(self) -> Task:
        words = self.rng.sample(WORDS, self.rng.randint(self.cfg.min_words, self.cfg.max_words))
        text = " ".join(words)
        self.next_id += 1
        return Task(self.next_id, tuple(self.prompt_ids(text)), text, " ".join(reversed(words)))

    def answer(self, completion_ids: list[int]) -> str:
        return self.tokenizer.decode(list(completion_ids), skip_special_tokens=True).strip()

    def score(self, task: Task, completion_ids: list[int]) -> float:
        return similarity(self.answer(completion_ids), task.target)

    def state(self) -> dict:
        return {"next_id": self.next_id, "rng": repr(self.rng.getstate())}
