"""nemotron_h against transformers' NemotronHForCausalLM (5.24, its PyTorch reference scan on CPU).

One tiny config with every layer kind (Mamba-2, attention, dense MLP, MoE with a latent width,
grouped routing and a shared expert), weights scaled up before saving so that every branch moves
the logits well above float32 rounding. Checked: logits (also left-padded), gradients of every
parameter, Router Replay, cached decode against the full forward, the embedded engine's greedy
tokens against ``generate`` with 3 prompts on 2 batch rows (cache merge and select), the
config.json round trip, and ``from_pretrained`` of a directory written from ours.
"""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from tests.models.parity import (assert_engine_greedy_matches_hf, assert_grads_match, assert_logits_match,
                                 assert_router_replay, checkpoint_state, hf_reference, load_into, rel_err)
from workers.common.registry import MODELS
from workers.models.nemotron_h.config import NemotronHConfig
from workers.models.nemotron_h.hf_config import from_hf_config, to_hf_config
from workers.models.nemotron_h.model import NemotronHForCausalLM

V = 128
HF_KW = dict(vocab_size=V, hidden_size=32, layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=4,
             mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4, n_routed_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=24, moe_shared_expert_intermediate_size=40, moe_latent_size=16, n_shared_experts=1,
             n_group=2, topk_group=1, routed_scaling_factor=2.5, max_position_embeddings=64)


def salient(dt_bias: float = None):
    """Weights of order 1/sqrt(fan_in) (transformers' init leaves the Mamba and MoE branches ~1e-4 of the
    residual); ``dt_bias`` set: every head's dt far above the time_step_min floor."""
    def prepare(hf):
        gen = torch.Generator().manual_seed(1)
        for name, p in hf.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif leaf == "A_log":
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 8 + 0.5))
            elif leaf == "dt_bias":
                if dt_bias is not None:
                    p.fill_(dt_bias)
            elif leaf in ("D", "bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return prepare


def checkpoint_name(name: str) -> str:
    """transformers keeps NemotronH's backbone as ``model.``; its checkpoints call it ``backbone.``."""
    return "backbone." + name[len("model."):] if name.startswith("model.") else name


def ours_config(**over) -> NemotronHConfig:
    from transformers import NemotronHConfig as HfConfig

    return NemotronHConfig(name="t", **from_hf_config(HfConfig(**HF_KW, **over).to_dict()))


def pair(tmp_path, dt_bias=None):
    from transformers import NemotronHConfig as HfConfig

    hf, d = hf_reference(HfConfig(**HF_KW), tmp_path, prepare=salient(dt_bias))
    cfg = NemotronHConfig(name="t", **from_hf_config(json.loads((d / "config.json").read_text())))
    return load_into(NemotronHForCausalLM(cfg), d), hf, d


def ids_of(b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, V, (b, t), generator=torch.Generator().manual_seed(seed))


def test_logits_grads_and_router_replay_match_transformers(tmp_path):
    ours, hf, _ = pair(tmp_path)
    assert ours.num_routed_layers == ours.config.num_routed_layers == 1
    ids = ids_of(2, 13)
    err = assert_logits_match(ours, hf, ids)
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, :5] = 0  # left padding, as the engine prefills
    err_pad = assert_logits_match(ours, hf, ids, attention_mask=mask)
    assert_logits_match(ours, hf, ids_of(1, 150, seed=9))  # several scan chunks
    with torch.no_grad():  # a padded row equals the same tokens unpadded: pads never touch the Mamba state
        padded = ours(ids, attention_mask=mask).logits[1, 5:]
        alone = ours(ids[1:, 5:]).logits[0]
    assert rel_err(padded, alone) <= 1e-5
    gerr = assert_grads_match(ours, hf, ids, rename=checkpoint_name)
    assert_router_replay(ours, ids)
    print(f"nemotron_h logits {err:.1e} (padded {err_pad:.1e}), grads {gerr:.1e}")


def test_cached_decode_equals_the_full_forward(tmp_path):
    # dt_bias high: the time_step_min floor (applied in full forwards only, as the reference) never binds.
    ours, _, _ = pair(tmp_path, dt_bias=1.0)
    ids = ids_of(2, 10, seed=3)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, :3] = False
    with torch.no_grad():
        full = [ours(ids[:1, 3:]).logits[0], ours(ids[1:]).logits[0]]
        cache = ours.new_cache()
        pos = (mask.long().cumsum(1) - 1).clamp_min(0)
        first = ours(ids[:, :6], attention_mask=mask[:, :6], position_ids=pos[:, :6], cache=cache).logits
        assert rel_err(first[0, 3:], full[0][:3]) <= 1e-5 and rel_err(first[1], full[1][:6]) <= 1e-5
        for t in range(6, 10):
            step = ours(ids[:, t:t + 1], position_ids=pos[:, t:t + 1], cache=cache).logits[:, 0]
            assert rel_err(step[0], full[0][t - 3]) <= 1e-5, t
            assert rel_err(step[1], full[1][t]) <= 1e-5, t
        assert cache.states[0][1].dtype == torch.float32 and cache.keys[2].shape[2] == 10
        chunked = ours.new_cache()  # several new tokens onto a cache (chunked prefill): from the cached state
        ours(ids[1:, :4], cache=chunked)
        assert rel_err(ours(ids[1:, 4:], cache=chunked).logits[0], full[1][4:]) <= 1e-5


def test_cached_steps_equal_transformers_cached_steps(tmp_path):
    """With transformers' dt init the time_step_min floor binds in some heads: its prefill clamps dt,
    its one-token cached step does not, and ours must do both the same (greedy tokens alone would
    not show a 1e-4 difference)."""
    ours, hf, _ = pair(tmp_path)
    ids = ids_of(2, 9, seed=5)
    with torch.no_grad():
        out = hf(input_ids=ids[:, :5], use_cache=True)
        hf_cache, cache = out.cache, ours.new_cache()
        assert rel_err(ours(ids[:, :5], cache=cache).logits, out.logits) <= 1e-5
        for t in range(5, 9):
            out = hf(input_ids=ids[:, t:t + 1], cache=hf_cache, use_cache=True)
            hf_cache = out.cache
            err = rel_err(ours(ids[:, t:t + 1], cache=cache).logits, out.logits)
            assert err <= 1e-5, f"step {t}: {err:.1e}"


def test_engine_greedy_equals_transformers_generate(tmp_path):
    ours, hf, _ = pair(tmp_path)
    assert_engine_greedy_matches_hf(ours, hf, [[5, 9, 17, 3], [7, 2, 44, 61, 8, 90, 12], [33]],
                                    max_new_tokens=6, max_batch_size=2)


def test_a_directory_written_from_ours_loads_in_transformers(tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, NemotronHConfig as HfConfig

    cfg = ours_config()
    ours = NemotronHForCausalLM(cfg).init_weights(7).eval()
    out = tmp_path / "ours"
    out.mkdir()
    save_file({k: v.contiguous() for k, v in ours.state_dict().items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(to_hf_config(cfg)))
    hf, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert isinstance(hf.config, HfConfig) and hf.config.layers_block_type == HF_KW["layers_block_type"]
    assert_logits_match(ours, hf.eval(), ids_of(2, 9))
    assert set(checkpoint_state(out)) == set(ours.state_dict())


def test_config_round_trip_and_refusals():
    from transformers import NemotronHConfig as HfConfig

    cfg = ours_config()
    hf_json = to_hf_config(cfg)
    assert NemotronHConfig(name="t", **from_hf_config(hf_json)) == cfg
    hf = HfConfig(**{k: v for k, v in hf_json.items() if k not in ("architectures", "model_type")})
    assert hf.hybrid_override_pattern == "ME*-" and hf.moe_latent_size == 16 and hf.n_groups == 2
    legacy = {k: v for k, v in hf_json.items() if k != "layers_block_type"} | {"mamba_n_groups": 2}
    legacy.pop("n_groups")
    assert from_hf_config(legacy) == from_hf_config(hf_json)  # hybrid_override_pattern and the mamba_* aliases
    names = ["mamba", "moe", "attention", "mlp"]  # Nemotron-3.5 / transformers 4.x list names
    assert from_hf_config(hf_json | {"layers_block_type": names}) == from_hf_config(hf_json)
    for key, value in [("mlp_hidden_act", "silu"), ("tie_word_embeddings", True), ("use_bias", True),
                       ("quantization_config", {"quant_method": "fp8"}), ("num_hidden_layers", 7)]:
        with pytest.raises(ValueError, match=key):
            from_hf_config(hf_json | {key: value})
    with pytest.raises(ValueError, match="layers_block_type"):
        from_hf_config(hf_json | {"layers_block_type": ["mamba", "sliding_attention"]})


def test_built_on_meta_counts_what_the_plan_counts():
    spec = MODELS.get("nemotron_h")
    cfg = ours_config()
    model = spec.build(cfg, device="meta", dtype="bfloat16")
    params = dict(model.named_parameters())
    assert all(p.is_meta for p in params.values())
    # the routers stay float32, as transformers keeps them (_keep_in_fp32_modules_strict)
    assert {n for n, p in params.items() if p.dtype != torch.bfloat16} == {"backbone.layers.1.mixer.gate.weight"}
    assert model.backbone.layers[1].mixer.gate.e_score_correction_bias.dtype == torch.float32
    params = list(params.values())
    assert sum(p.numel() for p in params) == spec.params(cfg).total
    counts = spec.params(cfg)
    assert counts.active == counts.total - 2 * 2 * 16 * 24  # two of four latent experts idle per token
    assert spec.kv_bytes_per_token(cfg, 2) == 2 * 2 * 8 * 2  # one attention layer's k and v, 2 kv heads


def test_the_ultra_preset_is_a_transformers_config_of_the_counted_size():
    from transformers import AutoModelForCausalLM, NemotronHConfig as HfConfig

    from tests.conftest import compose

    m = compose(["model=nemotron3_ultra"]).model
    hf_json = to_hf_config(m)
    cfg = HfConfig(**{k: v for k, v in hf_json.items() if k not in ("architectures", "model_type")})
    assert cfg.num_hidden_layers == 108 and cfg.moe_latent_size == 2048 and cfg.n_routed_experts == 512
    assert NemotronHConfig(name=m.name, **from_hf_config(hf_json)) == dataclasses.replace(m, init_seed=1234)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg)
    assert sum(p.numel() for p in hf.parameters()) == MODELS.get("nemotron_h").params(m).total


@pytest.mark.parametrize("t", [1, 5, 64, 150])
def test_the_chunked_scan_equals_the_token_by_token_recurrence(t):
    from workers.models.blocks.mamba2 import Mamba2Mixer

    mixer = Mamba2Mixer(hidden_size=16, num_heads=4, head_dim=8, n_groups=2, state_size=8, conv_kernel=4, eps=1e-5,
                        time_step_min=1e-3)
    gen = torch.Generator().manual_seed(t)
    x, bm, cm = (torch.randn(2, t, *shape, generator=gen) for shape in ((4, 8), (2, 8), (2, 8)))
    dt = torch.rand(2, t, 4, generator=gen) * 0.5
    h0 = torch.randn(2, 4, 8, 8, generator=gen)
    with torch.no_grad():
        y1, h1 = mixer.scan(x, dt, bm, cm, h0, chunk=1)
        y2, h2 = mixer.scan(x, dt, bm, cm, h0)
    assert rel_err(y2, y1) <= 1e-5 and rel_err(h2, h1) <= 1e-5


def test_bfloat16_serves_and_checkpoints_drop_mtp_layers(tmp_path):
    spec = MODELS.get("nemotron_h")
    cfg = dataclasses.replace(ours_config(), init_seed=3)
    full, half = spec.init(cfg, "float32").eval(), spec.init(cfg, "bfloat16").eval()
    ids = ids_of(2, 7)
    with torch.no_grad():
        want = full(ids).logits
        cache = half.new_cache()
        got = torch.cat([half(ids[:, :5], cache=cache).logits] +
                        [half(ids[:, t:t + 1], cache=cache).logits for t in (5, 6)], dim=1)
    assert got.dtype == torch.bfloat16 and cache.states[0][1].dtype == torch.float32
    assert rel_err(got.float(), want) < 3e-2  # bf16 rounding, not a different function
    state = {k: v for k, v in full.state_dict().items()} | {"mtp.layers.0.norm.weight": torch.ones(32)}
    full.load_state_dict(spec.from_hf(state), strict=True)
