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


GENERIC = {  # architectures no native family covers, each with what makes it unlike our decoders
    # partial rotary (a non-persistent inv_freq buffer), LayerNorm, parallel attention + MLP, an lm_head bias
    "phi": ("PhiConfig", "PhiForCausalLM",
            dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=128, tie_word_embeddings=False)),
    # learned positions, Conv1D projections, a tied head, transformers' names under ``transformer.h``
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=0)),
}


def generic_dir(directory: Path, kind: str = "phi", *, tokenizer_vocab: int = 0, seed: int = 0, **overrides) -> Path:
    """Save a tiny seeded checkpoint of an architecture no native family covers (``GENERIC``) into
    ``directory`` with ``save_pretrained``; ``tokenizer_vocab`` > 0 adds a tokenizer."""
    import transformers

    config_class, model_class, sizes = GENERIC[kind]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**{**sizes, **overrides})
    config.architectures = [model_class]
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():  # non-trivial biases and norms (zeros and ones hide a wrong bias or norm path)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln" in name or "layernorm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(directory)
    if tokenizer_vocab:
        save_tokenizer(directory, tokenizer_vocab)
    return Path(directory)
