"""Family ``qwen3`` (Qwen3ForCausalLM: Qwen3-0.6B ... 32B dense): config.py schema, spec.py registration;
the torch module is the shared dense decoder (workers/models/dense/)."""
