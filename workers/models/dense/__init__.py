"""The dense decoder shared by model families ``qwen3``, ``qwen2`` and ``mistral``: config.py (the
schema they subclass), model.py (the torch module from the shared blocks), family.py (their
config.json mapping, plan checks, facts and ModelSpec, built once for all three)."""
