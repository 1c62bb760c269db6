"""Write a small random Llama checkpoint in Hugging Face layout, to try ``model.path`` without a
download (a real one, such as a fine-tuned Llama or Qwen directory, is used the same way).

    python docs/examples/byot/make_checkpoint.py /tmp/my-llama            # byte-level: vocab 264
    python docs/examples/byot/make_checkpoint.py /tmp/my-llama --vocab 64 # too small for bytes

The vocabulary is 264 so env=dataset can read text byte-level (it has no tokenizer files); a
checkpoint with tokenizer files (tokenizer.json + chat template) is read with its own tokenizer.
Needs transformers (``pip install -e '.[dev]'``).
"""
from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="directory to write (config.json + model.safetensors)")
    p.add_argument("--vocab", type=int, default=264, help="vocabulary size (>= 264 for byte-level text)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.manual_seed(a.seed)
    config = LlamaConfig(vocab_size=a.vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
    LlamaForCausalLM(config).save_pretrained(a.out)
    print(f"wrote {a.out}: Llama, vocab {a.vocab}, 2 layers, hidden 64, context 128")


if __name__ == "__main__":
    main()
