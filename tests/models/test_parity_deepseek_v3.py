"""deepseek_v3 (DeepSeek-V3 / Kimi-K2) against transformers' DeepseekV3ForCausalLM on tiny configs.

Our model is configured from transformers' own config.json (``from_hf_config``), loads its
``save_pretrained`` checkpoint strictly, and must match: logits (also left-padded), gradients of
every parameter, Router Replay, greedy generation through the embedded engine (latent KV cache,
continuous batching), and ``from_pretrained`` of a directory written from our weights and
``to_hf_config``. Variants cover q_lora_rank 0 and > 0, grouped routing, YaRN on and off, and both
rotary layouts.
"""
from __future__ import annotations

import pytest
import torch

from tests.models.parity import (assert_engine_greedy_matches_hf, assert_grads_match, assert_logits_match,
                                 assert_router_replay, load_into, rel_err)
from workers.common.registry import MODELS

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}
BASE = dict(vocab_size=96, hidden_size=48, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
            num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, kv_lora_rank=16,
            q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, first_k_dense_replace=1,
            max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False, num_nextn_predict_layers=0)
VARIANTS = {
    "q_lora_yarn_interleaved": dict(rope_parameters=YARN, max_position_embeddings=16384),
    "q_proj_plain_rope": dict(q_lora_rank=None, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    "half_split_rope_one_group": dict(rope_interleave=False, n_group=1, topk_group=1, rope_parameters=YARN,
                                      max_position_embeddings=16384),
}


def hf_model(kw: dict, tmp_path, family: str = "deepseek_v3", seed: int = 0):
    """transformers' model (float32, eval) with a random correction bias and larger router weights (so the
    choice depends on both), saved with save_pretrained; returns (model, directory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **kw), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, t in list(hf.named_parameters()) + list(hf.named_buffers()):
            if name.endswith("gate.weight"):
                t.normal_(0, 0.5)
            elif name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape) * 0.1)
    out = tmp_path / "hf"
    hf.save_pretrained(out)
    return hf, out


def ours_from(hf, model_dir, family: str = "deepseek_v3"):
    """Our model configured from transformers' config.json (``from_hf_config``) with its checkpoint."""
    spec = MODELS.get(family)
    cfg = spec.config(name="t", **spec.from_hf_config(hf.config.to_dict()))
    return load_into(spec.build(cfg, dtype=torch.float32), model_dir), cfg


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_grads_replay_and_generation_match_transformers(variant, tmp_path):
    hf, d = hf_model({**BASE, **VARIANTS[variant]}, tmp_path)
    ours, cfg = ours_from(hf, d)
    assert ours.num_routed_layers == cfg.num_routed_layers == 2  # first_k_dense_replace=1 of 3
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(1))
    assert_logits_match(ours, hf, ids)
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, :5] = 0  # left padding, as the engine prefills
    assert_logits_match(ours, hf, ids, attention_mask=mask)
    assert_grads_match(ours, hf, ids)
    assert_router_replay(ours, ids)
    assert_engine_greedy_matches_hf(ours, hf, [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4]], max_new_tokens=5)


def test_checkpoint_written_from_ours_loads_in_transformers(tmp_path):
    """Our weights + to_hf_config make a directory transformers' from_pretrained loads with no missing or
    unexpected keys, computing our logits; the config round-trips through transformers' config class."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    spec = MODELS.get("deepseek_v3")
    hf, d = hf_model({**BASE, **VARIANTS["q_lora_yarn_interleaved"]}, tmp_path)
    _, cfg = ours_from(hf, d)
    ours = spec.init(cfg, torch.float32).eval()
    out = tmp_path / "ours"
    out.mkdir()
    save_file({k: v.contiguous() for k, v in ours.state_dict().items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(spec.to_hf_config(cfg)))
    loaded, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_err(ours(ids).logits, loaded.eval()(input_ids=ids).logits) <= 1e-5
    assert spec.config(name="t", **spec.from_hf_config(loaded.config.to_dict())) == cfg


def test_a_checkpoint_with_mtp_layers_passes_the_tensor_check_and_loads_without_them(tmp_path):
    """A DeepSeek-V3 checkpoint ships its MTP layer as ``model.layers.{num_hidden_layers}.*``: the launcher's
    tensor check and the loader skip exactly those (the spec's ``not_built``); any other stray tensor is
    still refused by name."""
    import json

    from safetensors.torch import load_file, save_file

    from workers.models.hf_checkpoint import check_model_path
    from workers.models.hf_dir import CheckpointError

    spec = MODELS.get("deepseek_v3")
    hf, d = hf_model(BASE, tmp_path)
    state = load_file(str(d / "model.safetensors"))
    n = BASE["num_hidden_layers"]
    mtp = {f"model.layers.{n}.eh_proj.weight": torch.randn(48, 96),
           f"model.layers.{n}.self_attn.kv_a_proj_with_mqa.weight": torch.randn(24, 48)}
    save_file({**state, **mtp}, str(d / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    cfg = spec.config(name="t", path=str(d), **spec.from_hf_config(json.loads((d / "config.json").read_text())))
    assert cfg.num_mtp_layers == 1
    check_model_path(cfg)
    loaded = spec.init(cfg, torch.float32).state_dict()
    assert set(loaded) == set(state) and all(torch.equal(loaded[k], state[k]) for k in state)
    save_file({**state, **mtp, f"model.layers.{n - 1}.stray.weight": torch.ones(2)}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"model.layers.{n - 1}.stray.weight"):
        check_model_path(cfg)


def test_unsupported_config_is_refused():
    spec = MODELS.get("deepseek_v3")
    good = spec.to_hf_config(spec.config(name="t", vocab_size=8, kv_lora_rank=4, qk_nope_head_dim=4,
                                         qk_rope_head_dim=4, v_head_dim=4))
    for key, value, match in [("hidden_act", "gelu", "hidden_act='gelu'"), ("attention_bias", True, "attention_bias"),
                              ("num_key_value_heads", 1, "num_key_value_heads=1"), ("sliding_window", 8, "sliding_window"),
                              ("quantization_config", {"quant_method": "fp8"}, "block FP8"),
                              ("topk_method", "greedy", "topk_method='greedy'"),
                              ("rope_scaling", {"type": "dynamic", "factor": 2.0}, "rope_scaling.type='dynamic'"),
                              ("rope_scaling", {"type": "yarn", "factor": 2.0, "foo": 1}, r"rope_scaling keys \['foo'\]")]:
        with pytest.raises(ValueError, match=match):
            spec.from_hf_config({**good, key: value})
