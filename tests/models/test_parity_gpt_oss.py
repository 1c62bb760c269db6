"""gpt_oss against transformers' GptOssForCausalLM on the same weights (tests/models/parity.py).

Tiny configs built with transformers' own GptOssConfig from our ``to_hf_config``: alternating
sliding-window (4 keys, shorter than every sequence here) and full layers, GQA with head_dim !=
hidden/heads, q/k/v/o biases and per-head sinks, YaRN with ``truncate`` off (and the unscaled
rotary), the biased router (softmax over the top-k logits), experts with biases and the clamped
SwiGLU (a low ``swiglu_limit`` so the clamps act). transformers initialises biases to 0 and sinks
near 0, so they are drawn at random before saving (otherwise untested). Each: logits (with and
without left padding), gradients by checkpoint name (experts fused, as the checkpoints keep
them), Router Replay, greedy generation through the dynamic and static engines, the config.json
round trip, transformers loading a directory written from OUR model, and an MXFP4 checkpoint of
the same weights loading into ours as transformers dequantises it. The sharded plans on real gloo
groups: tensor parallel in tests/integration/test_tp_native_families.py, expert parallel (the fused
stacks sharded over ep: parity, DCP resume at another ep, the published step loading here in
transformers) in tests/integration/test_gpt_oss_expert_parallel.py.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests.models.parity import (assert_engine_greedy_matches_hf, assert_from_pretrained_loads, assert_grads_match,
                                 assert_logits_match, assert_router_replay, checkpoint_state, hf_reference, load_into)
from tests.models.test_static_engine_parity import STATIC
from workers.common.registry import MODELS
from workers.models import mxfp4
from workers.models.gpt_oss.config import GptOssConfig
from workers.models.gpt_oss.model import GptOssForCausalLM
from workers.models.layer_types import FULL, SLIDING

BASE = GptOssConfig(name="t", vocab_size=96, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                    num_experts=8, top_k=2, expert_intermediate_size=32, sliding_window=4, layer_types=[SLIDING, FULL],
                    rope_theta=10000.0, rope_scaling="yarn", rope_factor=4.0, rope_original_max_position_embeddings=16,
                    rope_truncate=False, swiglu_limit=0.5, rms_norm_eps=1e-5, max_position_embeddings=64)
CONFIGS = {
    "gqa-yarn-window4": BASE,
    "mha-plain-rope-top3": dataclasses.replace(BASE, num_layers=3, num_kv_heads=4, top_k=3, rope_scaling="default",
                                               rope_factor=32.0, rope_original_max_position_embeddings=4096,  # unused
                                               layer_types=[FULL, SLIDING, SLIDING], sliding_window=3, swiglu_limit=7.0,
                                               tie_word_embeddings=True),
}
SPEC = MODELS.get("gpt_oss")
IDS = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(0))
ERRORS: dict[str, dict[str, float]] = {}  # printed with -s: the measured parity errors


def _hf_config(cfg: GptOssConfig):
    from transformers import GptOssConfig as HfGptOssConfig

    return HfGptOssConfig(**SPEC.to_hf_config(cfg))


def _random_biases_and_sinks(hf) -> None:
    for name, p in hf.named_parameters():
        if name.endswith(("bias", "sinks")):
            p.copy_(0.5 * torch.randn_like(p))
        elif "experts" in name:
            p.mul_(10.0)  # expert activations past swiglu_limit: the clamps act


@pytest.fixture(params=sorted(CONFIGS), scope="module")
def pair(request, tmp_path_factory):
    cfg = CONFIGS[request.param]
    hf, d = hf_reference(_hf_config(cfg), tmp_path_factory.mktemp(request.param), prepare=_random_biases_and_sinks)
    return request.param, cfg, load_into(GptOssForCausalLM(cfg), d), hf


def test_layers_and_parameter_count_are_transformers(pair):
    name, cfg, ours, hf = pair
    assert [layer.self_attn.sliding_window for layer in ours.model.layers] == [
        cfg.sliding_window if t == SLIDING else None for t in hf.config.layer_types]
    assert ours.num_routed_layers == cfg.num_routed_layers == cfg.num_layers
    assert sum(p.numel() for p in ours.parameters()) == SPEC.params(cfg).total == sum(p.numel() for p in hf.parameters())


def test_logits_match_with_and_without_left_padding(pair):
    name, cfg, ours, hf = pair
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :4] = 0  # left padding, as the engine prefills
    ERRORS.setdefault(name, {})["logits"] = assert_logits_match(ours, hf, IDS)
    ERRORS[name]["logits_left_pad"] = assert_logits_match(ours, hf, IDS, attention_mask=mask)


def test_gradients_match(pair):
    name, cfg, ours, hf = pair
    ERRORS.setdefault(name, {})["grads"] = assert_grads_match(ours, hf, IDS, split_experts=False)


def test_router_replay(pair):
    assert_router_replay(pair[2], IDS)


def test_engines_greedy_equal_transformers_generate(pair):
    name, cfg, ours, hf = pair
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9], [4]]
    assert_engine_greedy_matches_hf(ours, hf, prompts)
    assert_engine_greedy_matches_hf(ours, hf, prompts, max_new_tokens=7, make_engine=STATIC)


def test_config_json_round_trip(pair):
    name, cfg, ours, hf = pair
    assert GptOssConfig(name=cfg.name, **SPEC.from_hf_config(SPEC.to_hf_config(cfg))) == cfg
    assert GptOssConfig(name=cfg.name, **SPEC.from_hf_config(hf.config.to_dict())) == cfg


def test_transformers_loads_a_directory_written_from_our_model(pair, tmp_path):
    name, cfg, ours, hf = pair
    seeded = GptOssForCausalLM(cfg).init_weights(5).eval()
    with torch.no_grad():  # step 0 has zero biases (transformers' init): random ones check they are saved
        for n, p in seeded.named_parameters():
            if n.endswith("bias"):
                p.normal_(0.0, 0.5)
    ERRORS.setdefault(name, {})["from_pretrained"] = assert_from_pretrained_loads(
        seeded, SPEC.to_hf_config(cfg), tmp_path, IDS)
    print(f"\ngpt_oss parity errors: {ERRORS}")


def test_mxfp4_checkpoint_loads_dequantized(tmp_path):
    """A tiny MXFP4 directory as the released checkpoints are laid out (experts as ``*_blocks`` + ``*_scales``,
    ``quantization_config.quant_method: mxfp4``): ``model.path`` loads it into the bf16 model, which then
    computes transformers' logits on the same (exactly representable) expert weights."""
    from safetensors.torch import save_file

    from workers.models.hf_checkpoint import check_model_path

    def fp4_experts(hf):
        _random_biases_and_sinks(hf)
        for name, p in hf.named_parameters():
            if name.endswith(("gate_up_proj", "down_proj")) and p.dim() == 3:  # an FP4 code times 2^-3 or 2^-2
                codes = torch.randint(0, 16, p.shape)
                p.copy_(torch.tensor(mxfp4.FP4_VALUES)[codes] * 2.0 ** torch.randint(-3, -1, p.shape[:1] + (1, 1)))

    cfg = BASE
    hf, d = hf_reference(_hf_config(cfg), tmp_path, prepare=fp4_experts)
    quantized = tmp_path / "mxfp4"
    quantized.mkdir()
    state = {}
    for name, t in checkpoint_state(d).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            exps = torch.full((t.shape[0], t.shape[2], t.shape[1] // mxfp4.BLOCK), 0, dtype=torch.int32)
            exps += torch.log2(t.abs().amax(dim=(1, 2)) / 6.0).round().int().clamp(-3, -2).view(-1, 1, 1)
            state[name + "_blocks"], state[name + "_scales"] = mxfp4.pack(t, exps)
        else:
            state[name] = t.to(torch.bfloat16)
    save_file(state, str(quantized / "model.safetensors"), metadata={"format": "pt"})
    config = {**json.loads((d / "config.json").read_text()), "quantization_config": {"quant_method": "mxfp4"}}
    (quantized / "config.json").write_text(json.dumps(config))
    m = dataclasses.replace(cfg, path=str(quantized))
    check_model_path(m)  # the launcher's tensor check sees the logical tensors
    ours = GptOssForCausalLM.step0(m, torch.float32).eval()
    for name, t in hf.state_dict().items():  # experts exact; the rest as bf16 rounds it
        got = ours.state_dict()[name]
        assert torch.equal(got, t) if "experts." in name and t.dim() == 3 else torch.equal(got, t.bfloat16().float())
    hf.load_state_dict({k: v.bfloat16().float() for k, v in hf.state_dict().items()})  # the bf16 non-expert weights
    assert_logits_match(ours, hf, IDS)


@pytest.mark.parametrize("key, value, why", [
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0}, "rope_type='linear'"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.2, "rope_theta": 1e4},
     "attention_factor"),
    ("attention_dropout", 0.1, "attention_dropout=0.1 is not implemented"),
    ("quantization_config", {"quant_method": "mxfp4"}, "key 'quantization_config'"),
    ("experts_per_token", 5, "experts_per_token=5 disagrees"),
    ("architectures", ["Qwen3MoeForCausalLM"], "is not gpt_oss's"),
])
def test_config_json_keys_we_do_not_implement_are_refused(key, value, why):
    d = SPEC.to_hf_config(BASE)
    d[key] = value
    with pytest.raises(ValueError, match=why):
        SPEC.from_hf_config(d)


def test_gpt_oss_20b_config_as_published():
    """openai/gpt-oss-20b's config.json (public; transformers 4.55 keys, MXFP4 quantization_config, which
    model_fields strips) gives transformers' fields, the gpt_oss_20b preset, and its parameter count
    (20.9B; 3.6B active)."""
    from transformers import AutoModelForCausalLM, GptOssConfig as HfGptOssConfig

    published = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
                 "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
                 "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
                 "intermediate_size": 2880, "layer_types": [SLIDING, FULL] * 12, "max_position_embeddings": 131072,
                 "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
                 "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
                 "pad_token_id": 199999, "rms_norm_eps": 1e-05,
                 "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                  "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
                 "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
                 "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True,
                 "vocab_size": 201088}
    m = GptOssConfig(name="gpt-oss-20b", **SPEC.from_hf_config(published))
    from tests.conftest import compose

    assert dataclasses.replace(compose(["model=gpt_oss_20b"]).model, name=m.name) == m  # the preset is this config
    assert (m.num_experts, m.top_k, m.rope_scaling, m.rope_truncate, m.swiglu_alpha) == (32, 4, "yarn", False, 1.702)
    hf = HfGptOssConfig(**SPEC.to_hf_config(m))
    assert hf.rope_parameters == {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                                  "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0}
    with torch.device("meta"):
        total = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf).parameters())
    assert total == SPEC.params(m).total == 20_914_757_184
    # OpenAI's 3.6B active counts the unembedding but not the embedding lookup; ours counts both
    assert 3.6e9 < SPEC.params(m).active - m.vocab_size * m.hidden_size < 3.62e9


def test_tensor_and_expert_parallel_plan_onto_the_mesh_plan():
    """tp > 1 and ep > 1 take the mesh plan (world-2 parity: tests/integration/test_tp_native_families.py,
    tests/integration/test_gpt_oss_expert_parallel.py); the spec no longer refuses expert parallelism."""
    assert (SPEC.trainer_plan(1, 1), SPEC.trainer_plan(2, 1)) == ("fsdp", "mesh")
    assert (SPEC.trainer_plan(1, 2), SPEC.trainer_plan(2, 2)) == ("mesh", "mesh")
    assert not SPEC.no_expert_parallel
