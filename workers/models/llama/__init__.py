"""Family ``llama``: the dense decoder (SmolLM2, model=tiny_dense), i.e. tiny_moe's torch code with no
experts; config.py schema, spec.py registration, convert.py for pretrained GGUF checkpoints."""
