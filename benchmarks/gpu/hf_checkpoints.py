"""Hugging Face checkpoint directories made offline with transformers itself (no network: the GPU
machine has none): a seeded Qwen3-MoE (``Qwen3MoeForCausalLM.save_pretrained``) and a byte-level
BPE tokenizer with a chat template trained on a few strings. What ``model.path=`` reads, as a hub
checkpoint would be laid out; tests/models/hf_dirs.py uses the same tokenizer.
"""
from __future__ import annotations

from pathlib import Path

import torch

QWEN3_MOE_SIZES = {
    # ~0.35B total, ~60M active per token: a model that makes one H200 work, and fits it twice over
    "small": dict(vocab_size=8192, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=384,
                  num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=32,
                  num_experts_per_tok=4, max_position_embeddings=512),
    # seconds on a CPU
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                 max_position_embeddings=256),
}


def qwen3_moe_dir(directory: Path, *, size: str = "small", tokenizer_vocab: int = 400, seed: int = 0,
                  dtype: torch.dtype = torch.bfloat16) -> Path:
    """Save a seeded Qwen3MoeForCausalLM of ``size`` (QWEN3_MOE_SIZES) in ``dtype`` plus a tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**QWEN3_MOE_SIZES[size], rms_norm_eps=1e-6, tie_word_embeddings=False,
                            decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    config.architectures = ["Qwen3MoeForCausalLM"]
    model = Qwen3MoeForCausalLM(config).to(dtype)
    model.save_pretrained(directory)
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
