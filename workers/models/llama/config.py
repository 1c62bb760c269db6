"""Schema of model family ``llama``: a dense decoder, every layer a SwiGLU MLP (HF Llama names).

Torch-free. The torch model is tiny_moe's (workers/models/tiny_moe/model.py) on its dense path:
it reads ``num_experts`` (0 here, the base ModelConfig's answer) to choose it.
"""
from __future__ import annotations

import dataclasses

from workers.common.config.ranges import gt, limits
from workers.models.blocks.decoder_config import DecoderConfig


@dataclasses.dataclass(kw_only=True)
class LlamaConfig(DecoderConfig):
    """Dense Llama: no router, so Router Replay and routed-expert records do not apply."""

    family: str = "llama"
    """Model family (workers/models registry): chooses the schema of this section and the code that builds it."""
    dense_intermediate_size: int = 0
    """Hidden width of every layer's SwiGLU MLP (HF ``intermediate_size``); must be > 0."""


limits(LlamaConfig, dense_intermediate_size=gt(0))
