"""Schema of model family ``hf_generic``: any causal LM transformers builds, read from ``model.path``.

Torch-free. The launcher fills every field from the checkpoint's config.json (spec.py
``from_hf_config``, through transformers' own attribute names and defaults: hf_source.py); the
architecture itself is transformers' code (model.py), so the fields here are only what the plan
needs: sizes for the checks and the memory estimates, the class to build and how to run attention.
"""
from __future__ import annotations

import dataclasses

from workers.common.config.model import ModelConfig
from workers.common.config.ranges import NONEMPTY, ge, limits, one_of

ATTENTION = ("sdpa", "eager")
"""``model.attn_implementation`` choices: transformers' attention kernels that take its own masks
on every device (flash-attention needs the flash_attn package and no padded cache, so it is not offered)."""


@dataclasses.dataclass(kw_only=True)
class GenericConfig(ModelConfig):
    """A Hugging Face causal LM no native family covers: trained and served through transformers."""

    family: str = "hf_generic"
    """Model family (workers/models registry): chooses the schema of this section and the code that builds it."""
    architecture: str = ""
    """config.json ``architectures[0]`` (``PhiForCausalLM``): the class ``AutoModelForCausalLM`` builds."""
    model_type: str = ""
    """config.json ``model_type``: how transformers finds the config and model classes."""
    max_position_embeddings: int = 0
    """Longest sequence (prompt + completion) the model accepts: config.json's (``max_position_embeddings``
    or its attribute-map spelling, ``n_positions`` for GPT-2); when config.json has none, set it (0 is refused)."""
    num_kv_heads: int = 0
    """Key/value heads (``num_key_value_heads``); 0: num_heads. For the KV-cache estimate only."""
    head_dim: int = 0
    """Head width (``head_dim``); 0: hidden_size / num_heads. For the KV-cache estimate only."""
    tie_word_embeddings: bool = False
    """The output projection is the input embedding (config.json ``tie_word_embeddings``)."""
    attn_implementation: str = "sdpa"
    """transformers' attention kernel: ``sdpa`` (torch's scaled_dot_product_attention) or ``eager``."""

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads


limits(GenericConfig, architecture=NONEMPTY, model_type=NONEMPTY, max_position_embeddings=ge(0), num_kv_heads=ge(0),
       head_dim=ge(0), attn_implementation=one_of(*ATTENTION))
