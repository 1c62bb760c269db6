"""Schema of the glm_moe_dsa family (GLM-5): DeepSeek-V3's fields plus the DSA indexer. Torch-free."""
from __future__ import annotations

import dataclasses

from workers.common.config.ranges import Pattern, ge, gt, limits, one_of
from workers.models.deepseek_v3.config import DeepseekV3Config


@dataclasses.dataclass(kw_only=True)
class GlmMoeDsaConfig(DeepseekV3Config):
    family: str = "glm_moe_dsa"
    """Model family (workers/models registry): chooses the schema of this section and the code that builds it."""
    num_indexer_heads: int = 4
    """DeepSeek Sparse Attention indexer heads (``index_n_heads``)."""
    indexer_head_dim: int = 16
    """Indexer head width, its first ``qk_rope_head_dim`` channels rotated (``index_head_dim``)."""
    index_topk: int = 2048
    """Keys each query attends to, chosen by the indexer (``index_topk``)."""
    dsa_chunk_tokens: int = 256
    """The FEWEST queries the DSA indexer scores and sparse attention gathers at a time (workers/models/
    blocks/dsa_sparse.py): a chunk takes more when its constant byte budget allows (dsa_kernels.py
    ``SCORE_PAIRS``, dsa_sparse.py ``ATTENTION_BYTES``), so memory stays linear in the sequence. 0: the dense reference path (a [T, S] score and keep mask per layer: quadratic,
    for checking only). Not a config.json key: how we run the model, not what it is."""
    dsa_attention_kernel: str = "auto"
    """The memory-linear path's sparse attention: ``auto``, the fused Triton kernel on CUDA (workers/models/
    blocks/dsa_fused.py: no gathered keys, an online softmax, atomics for the keys' gradient) and torch
    elsewhere; ``torch``, the gathers in torch everywhere (the reference). Not a config.json key."""
    indexer_pattern: str = ""
    """Per layer ``F`` (the layer runs its indexer) or ``S`` (it reuses the last F layer's choice of keys
    and has no indexer weights) (``indexer_types`` full/shared); "": every layer F."""


limits(GlmMoeDsaConfig, num_indexer_heads=gt(0), indexer_head_dim=gt(0), index_topk=gt(0), dsa_chunk_tokens=ge(0),
       dsa_attention_kernel=one_of("auto", "torch"),
       indexer_pattern=Pattern(r"(F[FS]*)?", "'' or a string of F/S per layer starting with F"))


def indexer_types(m: GlmMoeDsaConfig) -> list[str]:
    """``full`` / ``shared`` per layer (transformers' ``indexer_types``)."""
    return [{"F": "full", "S": "shared"}[c] for c in (m.indexer_pattern or "F" * m.num_layers)]
