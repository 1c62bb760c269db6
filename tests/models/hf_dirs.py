"""Tiny Hugging Face checkpoint directories for the model.path tests, made with transformers itself.

``llama_dir`` saves a seeded ``LlamaForCausalLM`` (``save_pretrained``: what a hub checkpoint
looks like), optionally sharded and with a byte-level BPE tokenizer trained offline on a few
strings (``tokenizers`` + ``PreTrainedTokenizerFast``; benchmarks/gpu/hf_checkpoints.py), so no network is needed.
"""
from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.gpu.hf_checkpoints import save_tokenizer

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


TINY_DENSE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)


def hf_dir(directory: Path, architecture: str, model_type: str, *, tokenizer_vocab: int = 0, seed: int = 0,
           **overrides) -> Path:
    """Save a tiny seeded ``architecture`` (any transformers model type: ``CONFIG_MAPPING[model_type]``
    with :data:`TINY_DENSE` and ``overrides``) into ``directory``, as ``save_pretrained`` writes it."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = CONFIG_MAPPING[model_type](**{**TINY_DENSE, **overrides})
    config.architectures = [architecture]
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    if tokenizer_vocab:
        save_tokenizer(directory, tokenizer_vocab)
    return Path(directory)
