"""Registers model family ``llama``: the dense decoder (SmolLM2-135M, model=tiny_dense).

Same torch code as tiny_moe with no experts (workers/models/tiny_moe/model.py), same trainer
sharding (TP attention, TP MLP, vocabulary-parallel lm_head). No router: ``router_hook`` is None
and the plan refuses trainer.router_replay. Pretrained checkpoints: workers/models/pretrained.py
SOURCES of family llama, converted by workers/models/llama/convert.py.
"""
from __future__ import annotations

from workers.common.registry import MODELS
from workers.models.checks import check_gqa, check_mha, positive
from workers.models.facts import Architecture
from workers.models.llama import hf_config
from workers.models.llama.config import LlamaConfig
from workers.models.spec import ModelSpec
from workers.models.tiny_moe.spec import SHARDED, build, init


def arch(m: LlamaConfig) -> Architecture:
    return Architecture(vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers,
                        num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
                        dense_intermediate_size=m.dense_intermediate_size, tie_word_embeddings=m.tie_word_embeddings)


def check(cfg) -> None:
    m = cfg.model
    check_gqa(m)
    positive("model.dense_intermediate_size", m.dense_intermediate_size)
    check_mha(m)


SPEC = MODELS.register(ModelSpec(
    name="llama", config=LlamaConfig, check=check, arch=arch, build=build, init=init, parallelize=SHARDED,
    router_hook=None, hf_architectures=(hf_config.ARCHITECTURE,), to_hf_config=hf_config.to_hf_config,
    from_hf_config=hf_config.from_hf_config, summary="dense Llama decoder (tiny_moe's code with no experts; SmolLM2)"))
