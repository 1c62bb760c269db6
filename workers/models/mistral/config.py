"""Schema of model family ``mistral``: transformers' MistralForCausalLM.

Plain GQA (no biases, no q/k norms), a free head width (Mistral NeMo: 128 on 5120 with 32 heads) and
sliding-window attention on every layer where config.json sets ``sliding_window`` (Mistral-7B-v0.1:
4096; v0.3 and later: null). Torch-free.
"""
from __future__ import annotations

import dataclasses

from workers.models.dense.config import DenseConfig


@dataclasses.dataclass(kw_only=True)
class MistralConfig(DenseConfig):
    family: str = "mistral"
    """Model family (workers/models registry): chooses the schema of this section and the code that builds it."""
