"""The byte-level chat vocabulary's token ids, declared once: the agentic envs tokenize with them
(workers/orchestrator/envs/chat.py) and the published weights carry a tokenizer spelling the same
ids (workers/weights/filesystem/byte_tokenizer.py), so the two can never drift apart.

Specials first (like reverse_digits, so PAD stays 0): 0 PAD, 1 BOS, 2 EOT (end of turn; the stop
token), 3 USER, 4 ASSISTANT, 5 TOOL, 6..7 reserved, 8 + b for byte b (0..255).
"""
from __future__ import annotations

PAD, BOS, EOT, USER, ASSISTANT, TOOL = 0, 1, 2, 3, 4, 5
BYTE_OFFSET = 8
VOCAB_SIZE = BYTE_OFFSET + 256
SPECIAL_NAMES = {PAD: "<|pad|>", BOS: "<|bos|>", EOT: "<|eot|>", USER: "<|user|>", ASSISTANT: "<|assistant|>",
                 TOOL: "<|tool|>"}
