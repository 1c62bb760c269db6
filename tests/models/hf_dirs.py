"""Tiny Hugging Face checkpoint directories for the model.path tests, made with transformers itself.

``llama_dir`` saves a seeded ``LlamaForCausalLM`` (``save_pretrained``: what a hub checkpoint
looks like), optionally sharded and with a byte-level BPE tokenizer trained offline on a few
strings (``tokenizers`` + ``PreTrainedTokenizerFast``), so no network is needed.
"""
from __future__ import annotations

from pathlib import Path

import torch

TINY_LLAMA = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)


def llama_dir(directory: Path, *, max_shard_size: str | None = None, tokenizer_vocab: int = 0, seed: int = 0,
              dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """Save a tiny seeded Llama (in ``dtype``) into ``directory``; ``tokenizer_vocab`` > 0 adds a tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_LLAMA, **overrides})
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config).to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    if tokenizer_vocab:
        save_tokenizer(directory, tokenizer_vocab)
    return Path(directory)


def save_tokenizer(directory: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer of ``vocab_size`` ids with a chat template, trained on a few strings."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:vocab_size - 40])
    tok.train_from_iterator(["reverse the digits 1 2 3", "the quick brown fox", "hello world"] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    fast.save_pretrained(directory)
