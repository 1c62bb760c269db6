"""A model config's skeleton in a dtype named by the config: what the embedded engine serves and
what the orchestrator's fixed scorers (the KL reference, the distillation teacher) score with.

Why here, not in the engine: both roles build the same model from the same family registry; the
orchestrator importing the inference role's engine for it would tie two roles together.
"""
from __future__ import annotations

from workers.common.dtypes import check_name, torch_dtype
from workers.common.registry import MODELS
from workers.models.blocks.decoder import CausalLM


def model_from_config(model_cfg, dtype: str, device: str = "cpu") -> CausalLM:
    """Model skeleton of ``model_cfg``'s family (``ModelSpec.build``; weights come from a published step)."""
    check_name("inference.dtype", dtype)
    return MODELS.get(model_cfg.family).build(model_cfg, device=device, dtype=torch_dtype(dtype))
