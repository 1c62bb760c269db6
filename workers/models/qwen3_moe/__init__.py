"""Family ``qwen3_moe`` (Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B): config.py schema,
model.py torch module from the shared blocks, spec.py registration and config.json mapping."""
