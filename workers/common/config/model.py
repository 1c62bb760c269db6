"""Model section: what every model family has (``model/`` Hydra group; schema chosen by ``model.family``).

Each family's schema subclasses :class:`ModelConfig` in its home (workers/models/<family>/), so a
field the chosen family does not use is refused with its name instead of being dropped. Code that
reads MoE facts for any family (the orchestrator's routed-expert records, the plan's expert-parallel
and Router Replay checks, the simulator) reads :attr:`ModelConfig.num_experts` and
:attr:`ModelConfig.top_k`: a dense family answers 0, a MoE family's schema has them as fields.
Plan facts (parameter counts, KV bytes) come from the family's spec: workers/models/facts.py.
"""
from __future__ import annotations

import dataclasses

from omegaconf import MISSING

from workers.common.config.ranges import NONEMPTY, SEED, TEXT, gt, limits


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    family: str = MISSING
    """Model family (workers/models registry): chooses the schema of this section and the code that builds it."""
    name: str = MISSING
    """Preset name."""
    vocab_size: int = MISSING
    """Vocabulary size; must cover the environment's tokenizer."""
    hidden_size: int = 128
    """Residual stream width."""
    num_layers: int = 4
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads; must divide hidden_size."""
    max_position_embeddings: int = 512
    """Longest sequence (prompt + completion) the model accepts."""
    init_seed: int = 1234
    """Seed of the deterministic initial weights (step 0)."""
    pretrained: str = ""
    """Start from a pretrained checkpoint instead of the seeded init: a name of
    workers/models/pretrained.py SOURCES (``smollm2_135m``, family llama); "" = random init from init_seed."""
    pretrained_dir: str = ""
    """Where the converted checkpoint (safetensors + tokenizer) lives; "" lets the launcher pin
    $SLURMRL_CACHE (default ~/.cache/slurmrl)/pretrained/<pretrained>. Must be visible to every node.
    Only with ``pretrained`` (a Hugging Face directory is ``path``)."""
    path: str = ""
    """Start from a Hugging Face checkpoint directory (config.json + model.safetensors or a sharded
    model.safetensors.index.json; bf16/fp32, or DeepSeek-style block-FP8 dequantised on load). The
    launcher takes the family (config.json ``architectures``) and every architecture field from
    config.json (launcher/model_path.py); tokenizer and chat template come from the same directory
    when present. Must be visible to every node. "" = no checkpoint directory."""

    # A MoE family's schema declares these two as fields; the properties answer for dense families.
    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer; 0: dense (no router, no routed-expert records)."""
        return 0

    @property
    def top_k(self) -> int:
        """Experts chosen per token; 0: dense."""
        return 0

    @property
    def num_routed_layers(self) -> int:
        """Layers with a router, in order: the layer axis of routed-expert records and of Router
        Replay's ``forced_experts`` ``[B, T, num_routed_layers, top_k]``. A family with dense or
        non-MoE layers among its layers (DeepSeek-V3's first_k_dense_replace, Nemotron-H's mixers)
        overrides this; the model's ``num_routed_layers`` must agree (tests/models check it)."""
        return self.num_layers if self.num_experts > 0 else 0


limits(ModelConfig, family=NONEMPTY, name=NONEMPTY, vocab_size=gt(0), hidden_size=gt(0), num_layers=gt(0),
       num_heads=gt(0), max_position_embeddings=gt(0), init_seed=SEED, pretrained=TEXT, pretrained_dir=TEXT,
       path=TEXT)
