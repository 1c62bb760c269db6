"""Schema of model family ``qwen3_moe``: Qwen3-MoE exactly as transformers' Qwen3MoeForCausalLM.

GQA attention with per-head RMSNorm on queries and keys (before rotary) and a head width free of
hidden/heads; a softmax top-k MoE MLP in the layers ``decoder_sparse_step`` selects and
``mlp_only_layers`` does not exclude, a dense SwiGLU MLP in the others. Each field's docstring
names its config.json key (workers/models/qwen3_moe/spec.py maps them both ways). Torch-free.
"""
from __future__ import annotations

import dataclasses

from workers.common.config.ranges import Each, ge, gt, limits
from workers.models.blocks.decoder_config import DecoderConfig


@dataclasses.dataclass(kw_only=True)
class Qwen3MoeConfig(DecoderConfig):
    """Qwen3-MoE (HF Qwen3MoeConfig names in parentheses; the base fields map to ``vocab_size``,
    ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``max_position_embeddings``)."""

    family: str = "qwen3_moe"
    """Model family (workers/models registry): chooses the schema of this section and the code that builds it."""
    head_dim: int = 0
    """Width of one attention head (``head_dim``); 0: hidden_size / num_heads. Free of both (Qwen3-30B-A3B:
    128 on hidden 2048 with 32 heads); must be even (rotary embedding)."""
    num_experts: int = 8
    """Routed experts per MoE layer (``num_experts``; transformers 5 also writes ``num_local_experts``)."""
    top_k: int = 2
    """Experts chosen per token (``num_experts_per_tok``)."""
    expert_intermediate_size: int = 256
    """Hidden width of each expert's SwiGLU MLP (``moe_intermediate_size``)."""
    norm_topk_prob: bool = True
    """Renormalise the chosen experts' softmax probabilities to sum 1 (``norm_topk_prob``); off: the raw
    probabilities are the gate weights. The released Qwen3-MoE checkpoints set it; transformers' default is off."""
    decoder_sparse_step: int = 1
    """Layer i is MoE when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers
    (``decoder_sparse_step``); 1: every layer."""
    mlp_only_layers: list[int] = dataclasses.field(default_factory=list)
    """Layer indices with a dense MLP instead of MoE, whatever decoder_sparse_step says (``mlp_only_layers``)."""
    dense_intermediate_size: int = 0
    """Hidden width of the dense layers' SwiGLU MLP (``intermediate_size``); must be > 0 when any layer is dense."""

    @property
    def attention_head_dim(self) -> int:
        """The head width the model uses (``head_dim``, or hidden_size / num_heads when 0)."""
        return self.head_dim or self.hidden_size // self.num_heads

    def is_moe_layer(self, i: int) -> bool:
        """transformers' rule (Qwen3MoeDecoderLayer): MoE unless listed dense or off the sparse step."""
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0

    @property
    def num_routed_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def is_dense(self) -> bool:
        return self.num_routed_layers == 0


limits(Qwen3MoeConfig, head_dim=ge(0), num_experts=gt(0), top_k=gt(0), expert_intermediate_size=gt(0),
       decoder_sparse_step=gt(0), mlp_only_layers=Each(ge(0)), dense_intermediate_size=ge(0))
