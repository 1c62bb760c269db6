"""reverse_text: reverse the order of the words of a short text; reward = character similarity.

For a pretrained chat model (model.pretrained, e.g. SmolLM2-135M-Instruct): the prompt is
built with the model's OWN tokenizer and chat template, so the task reads like any chat
request, and the answer is decoded back to text before it is scored.

Why word order and not characters: a 135M model sees text as sub-word tokens, so reversing
the letters of a word asks it to spell tokens it never saw spelled (measured: no exact answer
in 96 samples, mean similarity 0.22); reversing the order of a few one-token words is the
same kind of verifiable "reverse a short text" task, one the model can already do sometimes
(5-12% exact with two worked examples), which is what RL needs: reward variance within a
group. Copying the text unchanged scores ~0.5, a correct reversal 1.0, other orders ~0.6.

Reward: ``difflib.SequenceMatcher(answer, target).ratio()`` = 2 * matched characters /
(len(answer) + len(target)), in [0, 1]: partial credit for partly right orders, and chatter
around the answer lowers it (the denominator grows), so "answer only" is learned too.

This module is the env's whole home: its config (the schema of ``env=reverse_text``), its plan
check, its tokenizer need (the model's own: ``vocab_size=None`` in its spec) and the env.
"""
from __future__ import annotations

import dataclasses
import difflib
import random
from typing import Any

from workers.common.config import EnvConfig
from workers.common.config.ranges import TEXT, between, gt, limits, positive
from workers.common.registry import ENVS
from workers.models.pretrained import require_prepared, tokenizer_dir
from workers.orchestrator.envs.base import GeneratedEvalSplit, SingleTurnEnv
from workers.orchestrator.envs.spec import EnvSpec

#: One-token English words (SmolLM2's BPE), so the task is about order, not spelling.
WORDS = ("red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "book", "fish", "bird", "milk", "rain", "door",
         "star", "car", "hat", "cup", "box", "pen")
PROMPT = "Reverse the word order: {text}"
#: Worked examples given as earlier chat turns. Measured on the base model (3 words, T=1.0, 96
#: samples): none -> mean similarity ~0.2 and rambling; two example turns -> ~0.6, 5% exact,
#: answers ~5 tokens long. Examples written into the user message instead did not help.
EXAMPLES = (("one two three", "three two one"), ("sky car tea", "tea car sky"))


@dataclasses.dataclass(kw_only=True)
class ReverseTextConfig(EnvConfig):
    name: str = "reverse_text"
    """Task name."""
    min_words: int = 3
    """Fewest words of a prompt's text."""
    max_words: int = 5
    """Most words of a prompt's text."""
    max_new_tokens: int = 24
    """Generation budget of the answer (stop token: the chat template's end of turn)."""
    system_prompt: str = ""
    """System message of the chat ("" keeps the model template's default)."""
    num_examples: int = 2
    """Worked examples, given as earlier user/assistant turns (0..2)."""


limits(ReverseTextConfig, min_words=gt(0), max_words=gt(0), max_new_tokens=gt(0), system_prompt=TEXT,
       num_examples=between(0, len(EXAMPLES)))


def check(run_cfg: Any) -> None:
    """Word and example counts fit the lists; the answer budget leaves room for the prompt
    (that the model is pretrained is the spec's tokenizer check)."""
    e = run_cfg.env
    positive("env.min_words", e.min_words)
    if not e.min_words <= e.max_words <= len(WORDS):
        raise ValueError(f"env.max_words({e.max_words}) must be in [env.min_words({e.min_words}), "
                         f"{len(WORDS)} (words in the list)]")
    positive("env.max_new_tokens", e.max_new_tokens)
    if not 0 <= e.num_examples <= len(EXAMPLES):
        raise ValueError(f"env.num_examples({e.num_examples}) must be in [0, {len(EXAMPLES)}]")
    if e.max_new_tokens >= run_cfg.model.max_position_embeddings:
        raise ValueError(f"env.max_new_tokens({e.max_new_tokens}) must be < model.max_position_embeddings"
                         f"({run_cfg.model.max_position_embeddings}): the prompt needs room too")


@dataclasses.dataclass(frozen=True)
class Task:
    task_id: int
    prompt_ids: tuple[int, ...]
    text: str
    target: str


def similarity(answer: str, target: str) -> float:
    """Character-level similarity in [0, 1] (1: identical)."""
    return difflib.SequenceMatcher(None, answer, target, autojunk=False).ratio()


class ReverseTextEnv(GeneratedEvalSplit, SingleTurnEnv):
    """Single-turn env over a pretrained model's tokenizer: ``sample_task`` -> chat prompt ids;
    ``score`` decodes the completion and compares it with the reversed text."""

    name = "reverse_text"

    def __init__(self, cfg: ReverseTextConfig, *, seed: int, model=None, tokenizer=None):
        if not 1 <= cfg.min_words <= cfg.max_words <= len(WORDS):
            raise ValueError(f"need 1 <= env.min_words({cfg.min_words}) <= env.max_words({cfg.max_words}) "
                             f"<= {len(WORDS)} (the word list)")
        if not 0 <= cfg.num_examples <= len(EXAMPLES):
            raise ValueError(f"env.num_examples({cfg.num_examples}) must be in [0, {len(EXAMPLES)}]")
        if tokenizer is None:
            directory = tokenizer_dir(model) if model is not None else None
            if directory is None:
                raise ValueError("env=reverse_text needs a pretrained model's tokenizer: set model.pretrained "
                                 "(e.g. model=smollm2_135m) or a model.path with tokenizer files")
            from workers.models.pretrained import load_tokenizer  # transformers: only this env needs it

            tokenizer = load_tokenizer(require_prepared(model) if model.pretrained else directory)
        self.cfg, self.tokenizer = cfg, tokenizer
        self.rng = random.Random(seed * 1_000_003 + cfg.seed)
        self.next_id = 0
        self.max_new_tokens = cfg.max_new_tokens
        self.stop_token_ids = (int(tokenizer.eos_token_id),)

    def prompt_ids(self, text: str) -> list[int]:
        messages = [{"role": "system", "content": self.cfg.system_prompt}] if self.cfg.system_prompt else []
        for question, answer in EXAMPLES[: self.cfg.num_examples]:
            messages += [{"role": "user", "content": PROMPT.format(text=question)},
                         {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": PROMPT.format(text=text)})
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
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


ENVS.register(EnvSpec(name="reverse_text", config=ReverseTextConfig, vocab_size=None, env_check=check, eval_split=True,
                      make=lambda cfg, *, seed, model=None: ReverseTextEnv(cfg, seed=seed, model=model),
                      summary="reverse the word order of a short text, in a pretrained model's chat template"))
