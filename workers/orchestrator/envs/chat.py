"""Byte-level tokenizer and chat template for agentic envs on the tiny model.

Why bytes: code, paths and tool output use every printable character, and the tiny
MoE has no pretrained tokenizer; a byte vocabulary covers all text losslessly with 264
ids, so ``model.vocab_size`` only needs to be >= ``VOCAB_SIZE`` (tiny_code_repair sets it).

Token ids (workers/common/byte_vocab.py, shared with the tokenizer files the published weights
carry): 0 PAD, 1 BOS, 2 EOT (end of turn; the stop token), 3 USER, 4 ASSISTANT, 5 TOOL,
6..7 reserved, 8 + b for byte b (0..255).

Template (every message = role token + UTF-8 bytes + EOT; the prompt ends with ASSISTANT
so the model speaks next)::

    BOS USER <task> EOT ASSISTANT <model turn> EOT TOOL <observation> EOT ASSISTANT <model turn> ...

Prefix rule (why ``observation_ids`` takes ``turn_ids``): a multi-turn episode never
re-tokenizes what the model produced. The next prompt is the exact previous prompt +
the model's token ids + the observation's ids, so per-token logprobs and routed experts
of earlier turns stay valid positions of later turns. When the model stopped without EOT
(length limit) the template closes its turn with an EOT that counts as an env token.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from workers.common.byte_vocab import ASSISTANT, BOS, BYTE_OFFSET, EOT, SPECIAL_NAMES, TOOL, USER, VOCAB_SIZE

ROLE_TOKENS = {"user": USER, "assistant": ASSISTANT, "tool": TOOL, "system": USER}


class ByteTokenizer:
    """UTF-8 bytes <-> ids; decoding never fails (bad bytes become U+FFFD, specials are dropped
    by ``decode`` and spelled out by ``render``)."""

    vocab_size = VOCAB_SIZE

    @staticmethod
    def encode(text: str) -> list[int]:
        return [BYTE_OFFSET + b for b in text.encode("utf-8", errors="replace")]

    @staticmethod
    def decode(ids: Iterable[int]) -> str:
        return bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < VOCAB_SIZE).decode("utf-8", errors="replace")

    @staticmethod
    def render(ids: Iterable[int]) -> str:
        """Human-readable text with special tokens spelled out (logs, debugging)."""
        out, buf = [], []
        for i in ids:
            if BYTE_OFFSET <= i < VOCAB_SIZE:
                buf.append(i - BYTE_OFFSET)
                continue
            if buf:
                out.append(bytes(buf).decode("utf-8", errors="replace"))
                buf = []
            out.append(SPECIAL_NAMES.get(i, f"<|{i}|>"))
        if buf:
            out.append(bytes(buf).decode("utf-8", errors="replace"))
        return "".join(out)


class ChatTemplate:
    """Builds prompts and observations as token ids; see the module docstring for the layout."""

    stop_token_ids: tuple[int, ...] = (EOT,)

    def __init__(self, tokenizer: ByteTokenizer | None = None):
        self.tok = tokenizer or ByteTokenizer()

    def message_ids(self, role: str, content: str) -> list[int]:
        if role not in ROLE_TOKENS:
            raise ValueError(f"unknown chat role {role!r}; choose one of {sorted(ROLE_TOKENS)}")
        return [ROLE_TOKENS[role], *self.tok.encode(content), EOT]

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        """BOS + every message + ASSISTANT: the first prompt of an episode."""
        ids = [BOS]
        for m in messages:
            ids += self.message_ids(m["role"], m["content"])
        return ids + [ASSISTANT]

    def observation_ids(self, turn_ids: Sequence[int], text: str, *, role: str = "tool") -> list[int]:
        """Tokens appended after the model's ``turn_ids``: [EOT if the turn is open] + message + ASSISTANT."""
        close = [] if turn_ids and turn_ids[-1] == EOT else [EOT]
        return [*close, *self.message_ids(role, text), ASSISTANT]

    def turn_text(self, turn_ids: Sequence[int]) -> str:
        """What the model wrote in one turn, as text (stop token and specials dropped)."""
        return self.tok.decode(turn_ids)
