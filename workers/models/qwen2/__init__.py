"""Family ``qwen2`` (Qwen2ForCausalLM: Qwen2, Qwen2.5, Qwen2.5-Math / -Coder): config.py schema,
spec.py registration; the torch module is the shared dense decoder (workers/models/dense/)."""
