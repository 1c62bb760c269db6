"""Family ``gemma3_text`` (Gemma3ForCausalLM: Gemma 3 270M / 1B, the text decoder of the larger ones):
config.py schema, model.py torch module from the shared blocks, spec.py registration and config.json mapping."""
