"""Schema of tiny_moe, the decoder family built by workers/models/tiny_moe/model.py (llama too).

``DecoderConfig`` (workers/models/blocks/decoder_config.py, shared with llama and qwen3_moe) holds
what the torch model reads beyond the base ModelConfig; ``TinyMoeConfig`` adds the routed experts.
The dense Llama variant (workers/models/llama/config.py) adds a dense MLP width instead. The torch
model takes either directly (no copying into another dataclass); a field one of them
lacks is refused when the config is composed or loaded, with the field named. Torch-free.
"""
from __future__ import annotations

import dataclasses

from workers.common.config.ranges import gt, limits
from workers.models.blocks.decoder_config import INIT_STD, DecoderConfig  # noqa: F401  (re-exported)


@dataclasses.dataclass(kw_only=True)
class TinyMoeConfig(DecoderConfig):
    """tiny_moe: every layer a top-k routed Mixture-of-Experts MLP (HF Qwen3-MoE names)."""

    family: str = "tiny_moe"
    """Model family (workers/models registry): chooses the schema of this section and the code that builds it."""
    num_experts: int = 8
    """Routed experts per MoE layer (> 0; a dense model is ``model.family=llama``)."""
    top_k: int = 2
    """Experts chosen per token."""
    expert_intermediate_size: int = 256
    """Hidden width of each expert's SwiGLU MLP."""


limits(TinyMoeConfig, num_experts=gt(0), top_k=gt(0), expert_intermediate_size=gt(0))
