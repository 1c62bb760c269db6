"""Model families: one folder per family, each registering a spec in workers.common.registry.MODELS."""
