"""The glm_moe_dsa torch model (GlmMoeDsaForCausalLM's checkpoint names): deepseek_v3's model with
the DeepSeek Sparse Attention indexer in each ``full`` layer's MLA (``self_attn.indexer.*``).

A ``shared`` layer (``indexer_pattern`` S) has no indexer and attends to the keys the last full
layer chose. ``dsa_chunk_tokens`` > 0: the memory-linear sparse path (workers/models/blocks/
dsa_sparse.py); 0: the dense reference path (workers/models/blocks/dsa_indexer.py ``restrict``).
"""
from __future__ import annotations

import torch

from workers.models.blocks.dsa_indexer import DsaIndexer
from workers.models.blocks.mla import MLAttention
from workers.models.deepseek_v3.model import DeepseekV3ForCausalLM, build_module, init_module, make_attention
from workers.models.glm_moe_dsa.config import GlmMoeDsaConfig, indexer_types


def make_dsa_attention(cfg: GlmMoeDsaConfig, layer: int) -> MLAttention:
    attn = make_attention(cfg, layer)
    if indexer_types(cfg)[layer] == "full":
        attn.indexer = DsaIndexer(hidden_size=cfg.hidden_size, q_lora_rank=cfg.q_lora_rank,
                                  num_heads=cfg.num_indexer_heads, head_dim=cfg.indexer_head_dim,
                                  rope_dim=cfg.qk_rope_head_dim, topk=cfg.index_topk)
    else:
        attn.reuses_index = True
    attn.dsa_chunk = cfg.dsa_chunk_tokens
    attn.dsa_kernel = cfg.dsa_attention_kernel
    return attn


class GlmMoeDsaForCausalLM(DeepseekV3ForCausalLM):
    attention = staticmethod(make_dsa_attention)


def build(cfg: GlmMoeDsaConfig, *, device=None, dtype=None) -> GlmMoeDsaForCausalLM:
    return build_module(GlmMoeDsaForCausalLM, cfg, device=device, dtype=dtype)


def init(cfg: GlmMoeDsaConfig, dtype=torch.float32) -> GlmMoeDsaForCausalLM:
    return init_module(GlmMoeDsaForCausalLM, cfg, dtype)
