"""Tokenizer files for the byte-level chat template (envs/chat.py), written into every published
step of a model that has no tokenizer of its own, so ``AutoTokenizer.from_pretrained(step_dir)``
prompts the trained model exactly as the run did (torch-free; plain JSON, no ``tokenizers`` needed
to write them).

The ids are workers/common/byte_vocab.py's (the envs' too): 0 PAD, 1 BOS, 2 EOT, 3 USER, 4 ASSISTANT, 5 TOOL, 6..7 reserved, 8 + b
for byte b. ``tokenizer.json`` is a byte-level BPE with no merges (each UTF-8 byte is one token,
spelled with GPT-2's printable byte alphabet) and the specials as added tokens;
``tokenizer_config.json`` carries a chat template rendering ``BOS (<role> text EOT)* ASSISTANT``,
so ``apply_chat_template(messages, add_generation_prompt=True)`` gives the ids of
``ChatTemplate.prompt_ids(messages)`` and generation stops at ``<|eot|>`` (the eos token).

When: a published step's model has no tokenizer (no ``model.path`` tokenizer, no
``model.pretrained``) and ``model.vocab_size`` >= 264, which is how env=dataset, code_repair and swe
read text for such a model (their plan checks require it). A smaller vocabulary belongs to an env
with its own token ids (reverse_digits): no tokenizer is written for it.
"""
from __future__ import annotations

import json

from workers.common.byte_vocab import BOS, BYTE_OFFSET, EOT, PAD, SPECIAL_NAMES, VOCAB_SIZE

SPECIALS = {**SPECIAL_NAMES, 6: "<|reserved_6|>", 7: "<|reserved_7|>"}
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
                 "{% if m['role'] == 'assistant' %}<|assistant|>{% elif m['role'] == 'tool' %}<|tool|>"
                 "{% else %}<|user|>{% endif %}{{ m['content'] }}<|eot|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what a ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def tokenizer_json() -> dict:
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, s in sorted(SPECIALS.items())],
        "normalizer": None, "pre_tokenizer": level, "post_processor": None, "decoder": level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {**{s: i for i, s in SPECIALS.items()},
                            **{c: BYTE_OFFSET + b for b, c in byte_alphabet().items()}},
                  "merges": []},
    }


def tokenizer_config() -> dict:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[BOS], "eos_token": SPECIALS[EOT],
            "pad_token": SPECIALS[PAD], "model_max_length": 1_000_000_000, "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False}


def byte_tokenizer_files() -> tuple[tuple[str, str], ...]:
    """(file name, text) of every file to write into a step directory."""
    return (("tokenizer.json", json.dumps(tokenizer_json(), ensure_ascii=False) + "\n"),
            ("tokenizer_config.json", json.dumps(tokenizer_config(), indent=1) + "\n"),
            ("special_tokens_map.json", json.dumps({"bos_token": SPECIALS[BOS], "eos_token": SPECIALS[EOT],
                                                    "pad_token": SPECIALS[PAD]}, indent=1) + "\n"))


def wants_byte_tokenizer(model_cfg) -> bool:
    """A model without a tokenizer whose vocabulary holds the byte template's ids (module docstring)."""
    return not getattr(model_cfg, "pretrained", "") and int(getattr(model_cfg, "vocab_size", 0)) >= VOCAB_SIZE
