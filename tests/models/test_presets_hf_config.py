"""The Kimi-K2 and GLM-5 presets hold the real checkpoints' config.json values: transformers' own config
classes accept ``to_hf_config`` of the composed presets, derive what the model code reads from it, and
``from_hf_config`` gives the preset back. The torch modules of a preset's shape are counted by the plan."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.conftest import compose
from workers.common.registry import MODELS

transformers = pytest.importorskip("transformers")

EXPECT = {  # config.json values the published checkpoints carry (see the preset YAMLs for sources)
    "kimi_k2": dict(hidden_size=7168, num_hidden_layers=61, first_k_dense_replace=1, n_routed_experts=384,
                    num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048, intermediate_size=18432,
                    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    num_attention_heads=64, n_group=1, topk_group=1, routed_scaling_factor=2.827, vocab_size=163840),
    "glm5": dict(hidden_size=6144, num_hidden_layers=78, first_k_dense_replace=3, n_routed_experts=256,
                 num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048, intermediate_size=12288,
                 q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
                 num_attention_heads=64, index_n_heads=32, index_head_dim=128, index_topk=2048, vocab_size=154880,
                 max_position_embeddings=202752, rms_norm_eps=1e-5),
}


@pytest.mark.parametrize("preset", sorted(EXPECT))
def test_preset_is_a_valid_transformers_config_of_the_checkpoint(preset):
    m = compose([f"model={preset}"]).model
    spec = MODELS.get(m.family)
    d = spec.to_hf_config(m)
    hf_cls = transformers.AutoConfig.for_model(d["model_type"]).__class__
    hf = hf_cls(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    for key, want in EXPECT[preset].items():
        assert getattr(hf, key) == want, f"{preset}: {key}={getattr(hf, key)!r}, the checkpoint has {want!r}"
    assert spec.hf_architectures == tuple(d["architectures"])
    back = spec.from_hf_config(hf.to_dict())
    assert {k: v for k, v in dataclasses.asdict(m).items() if k in back} == back


def test_kimi_k2_rope_is_yarn_as_released():
    m = compose(["model=kimi_k2"]).model
    hf = transformers.DeepseekV3Config(**MODELS.get("deepseek_v3").to_hf_config(m))
    rp = hf.rope_parameters
    assert (rp["rope_type"], rp["factor"], rp["original_max_position_embeddings"], rp["rope_theta"]) == \
        ("yarn", 32.0, 4096, 50000.0)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm_moe_dsa"])
def test_the_plan_counts_what_the_family_builds(family):
    """A small config of each shape (q_lora 0 for deepseek_v3, a shared indexer layer for GLM-5), on meta."""
    spec = MODELS.get(family)
    kw = dict(name="t", vocab_size=64, hidden_size=32, num_layers=3, num_heads=2, num_experts=4, top_k=2,
              expert_intermediate_size=8, num_shared_experts=1, num_dense_layers=1, dense_intermediate_size=16,
              kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
    kw.update(q_lora_rank=8, indexer_pattern="FFS", indexer_head_dim=8) if family == "glm_moe_dsa" else None
    m = spec.config(**kw)
    model = spec.build(m, device="meta", dtype="bfloat16")
    assert sum(p.numel() for p in model.parameters()) == spec.params(m).total
    assert model.num_routed_layers == m.num_routed_layers == 2
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {dtypes[n] for n in dtypes if n.endswith("mlp.gate.weight")} == {torch.float32}  # routers stay fp32
    assert dtypes["model.layers.0.self_attn.kv_b_proj.weight"] == torch.bfloat16


def test_a_kimi_k2_style_config_json_maps_onto_the_preset():
    """The original checkpoints' config.json form (remote-code keys, legacy ``rope_scaling`` + ``rope_theta``)
    gives the preset's fields; its FP8 ``quantization_config`` is refused until dequantisation exists."""
    m = compose(["model=kimi_k2"]).model
    spec = MODELS.get("deepseek_v3")
    d = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "auto_map": {"AutoConfig": "x"},
         "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 163584,
         "eos_token_id": 163585, "ep_size": 1, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 7168,
         "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 262144,
         "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 384,
         "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 8,
         "num_hidden_layers": 61, "num_key_value_heads": 64, "num_nextn_predict_layers": 0, "pretraining_tp": 1,
         "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
         "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                          "original_max_position_embeddings": 4096, "type": "yarn"},
         "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "seq_aux": True,
         "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
         "transformers_version": "4.48.3", "use_cache": True, "v_head_dim": 128, "vocab_size": 163840}
    fields = spec.from_hf_config(d)
    assert fields == {k: v for k, v in dataclasses.asdict(m).items() if k in fields}
    assert set(dataclasses.asdict(m)) - set(fields) == {"family", "name", "init_seed", "pretrained", "pretrained_dir", "path",
                                                        "rope_interleave"}
    with pytest.raises(ValueError, match="quantization_config"):
        spec.from_hf_config({**d, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
