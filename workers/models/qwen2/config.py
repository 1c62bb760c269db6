"""Schema of model family ``qwen2``: Qwen2 / Qwen2.5 exactly as transformers' Qwen2ForCausalLM.

Biases on the q/k/v projections (none on o_proj), GQA, tied (0.5B-3B) or untied head; no q/k norms.
Torch-free.
"""
from __future__ import annotations

import dataclasses

from workers.models.dense.config import DenseConfig


@dataclasses.dataclass(kw_only=True)
class Qwen2Config(DenseConfig):
    family: str = "qwen2"
    """Model family (workers/models registry): chooses the schema of this section and the code that builds it."""

    @property
    def qkv_bias(self) -> bool:
        return True
