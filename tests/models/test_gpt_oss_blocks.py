"""GPT-OSS's parts that need no attention: the MXFP4 format (workers/models/mxfp4.py), the checkpoint
reader's dequantisation of ``*_blocks`` + ``*_scales``, and the MoE block (workers/models/blocks/
moe_gpt_oss.py) against transformers' GptOssMLP on the same weights."""
from __future__ import annotations

import json

import pytest
import torch

from tests.models.parity import rel_err
from workers.models import mxfp4
from workers.models.blocks import kernels
from workers.models.blocks.moe_gpt_oss import GptOssMoe
from workers.models.hf_checkpoint import HFCheckpoint
from workers.models.hf_dir import CheckpointError, check_quantization

torch.set_num_threads(1)


def fp4_weights(e: int, n_in: int, n_out: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, in, out]`` values that are FP4 codes times a per-block power of two, and those exponents."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (e, n_in, n_out), generator=gen)
    exps = torch.randint(-3, 3, (e, n_out, n_in // mxfp4.BLOCK), generator=gen)
    values = torch.tensor(mxfp4.FP4_VALUES)[codes]
    scale = torch.ldexp(torch.ones(exps.shape), exps).repeat_interleave(mxfp4.BLOCK, dim=-1).transpose(1, 2)
    return values * scale, exps


def test_pack_then_dequantize_is_exact_and_matches_transformers_layout():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w, exps = fp4_weights(3, 64, 24)
    blocks, scales = mxfp4.pack(w, exps)
    assert blocks.dtype == scales.dtype == torch.uint8
    assert list(blocks.shape) == [3, 24, 2, 16] and list(scales.shape) == [3, 24, 2]
    assert mxfp4.logical_shape(list(blocks.shape)) == [3, 64, 24]
    ours = mxfp4.dequantize(blocks, scales)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours.float(), w)
    # transformers' own unpacking of the same bytes: the layout (nibble order, block axis, transpose) agrees
    assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32), w)
    # a known byte: low nibble 0b0011 (1.5), high nibble 0b1111 (-6.0), scale 2^1
    b = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    b[..., 0] = 0xF3
    s = torch.full((1, 1, 1), mxfp4.BIAS + 1, dtype=torch.uint8)
    assert mxfp4.dequantize(b, s, torch.float32)[0, :2, 0].tolist() == [3.0, -12.0]
    with pytest.raises(ValueError, match="not an FP4 code"):
        mxfp4.pack(w + 0.1, exps)


def test_checkpoint_reader_dequantizes_blocks_and_scales(tmp_path):
    from safetensors.torch import save_file

    w, exps = fp4_weights(2, 32, 16, seed=1)
    blocks, scales = mxfp4.pack(w, exps)
    bias = torch.randn(2, 16)
    save_file({"m.experts.gate_up_proj_blocks": blocks, "m.experts.gate_up_proj_scales": scales,
               "m.experts.gate_up_proj_bias": bias}, str(tmp_path / "model.safetensors"))
    ckpt = HFCheckpoint(tmp_path)
    assert ckpt.names() == ["m.experts.gate_up_proj", "m.experts.gate_up_proj_bias"]
    assert ckpt.shape("m.experts.gate_up_proj") == [2, 32, 16]
    assert torch.equal(ckpt.read("m.experts.gate_up_proj").float(), w)
    assert torch.equal(ckpt.read("m.experts.gate_up_proj", (slice(1, 2), slice(8, 24))).float(), w[1:2, 8:24])
    assert torch.equal(ckpt.read("m.experts.gate_up_proj_bias"), bias)


def test_quantization_configs_read_and_refused():
    check_quantization({"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}}, "c")
    with pytest.raises(CheckpointError, match="mxfp4"):
        check_quantization({"quantization_config": {"quant_method": "awq"}}, "c")


def _pair(seed: int = 0, e: int = 6, k: int = 2, h: int = 16, inter: int = 8):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    torch.manual_seed(seed)
    cfg = GptOssConfig(hidden_size=h, intermediate_size=inter, num_local_experts=e, num_experts_per_tok=k,
                       swiglu_limit=1.5)  # a low limit so the clamps act on these small activations
    hf = GptOssMLP(cfg).float()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    ours = GptOssMoe(hidden_size=h, num_experts=e, top_k=k, expert_intermediate_size=inter,
                     swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit)
    ours.load_state_dict(hf.state_dict(), strict=True)  # the same names and shapes: transformers' layout
    return ours, hf


def test_moe_block_matches_transformers_with_gradients():
    ours, hf = _pair()
    x = torch.randn(2, 5, 16) * 2
    x_ours, x_hf = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, idx, _, _ = ours(x_ours, None, None)
    want, scores = hf(x_hf)
    assert rel_err(y, want) < 1e-6
    gu = ours.experts.activation(x.reshape(-1, 16) @ ours.experts.gate_up_proj[0])  # the clamp is exercised
    assert (x.reshape(-1, 16) @ ours.experts.gate_up_proj[0]).abs().max() > 1.5 and gu.abs().max() > 0
    w = torch.randn_like(want)
    (y * w).sum().backward()
    (want * w).sum().backward()
    assert rel_err(x_ours.grad, x_hf.grad) < 1e-5
    for name, p in hf.named_parameters():
        assert rel_err(dict(ours.named_parameters())[name].grad, p.grad) < 1e-5, name
    # forcing the chosen experts reproduces the output; forcing others changes it (Router Replay)
    same, forced_idx, _, _ = ours(x, idx, None)
    assert torch.equal(same, y.detach()) or rel_err(same, y) < 1e-7
    other = (idx + 1) % 6
    changed, got, _, _ = ours(x, other, None)
    assert torch.equal(got, other) and rel_err(changed, y) > 1e-3


def test_grouped_gemm_path_equals_the_loop(monkeypatch):
    """bf16 grouped GEMM with per-row biases (the GPU path) against the per-expert loop."""
    ours, _ = _pair(seed=1, h=32, inter=16)
    ours = ours.to(torch.bfloat16)
    x = (torch.randn(3, 7, 32) * 2).to(torch.bfloat16)
    loop = ours(x, None, None)[0].float()
    monkeypatch.setattr(kernels, "FAST_PATH_ON_CPU", True)
    assert ours.experts.grouped_ok(x.reshape(-1, 32))
    grouped = ours(x, None, None)[0].float()
    assert (grouped - loop).abs().max() <= 0.02 * loop.abs().max()


def test_mxfp4_config_key_is_stripped_by_model_fields(tmp_path):
    """A quantized directory's config.json: quantization_config is how weights are stored, not a model key."""
    from transformers import GptOssConfig

    from workers.models.hf_dir import model_fields

    d = GptOssConfig(num_hidden_layers=2, hidden_size=32, head_dim=8, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=32, num_local_experts=4, vocab_size=64).to_dict()
    d.update(architectures=["GptOssForCausalLM"], quantization_config={"quant_method": "mxfp4"})
    (tmp_path / "config.json").write_text(json.dumps(d))
    spec, fields = model_fields(tmp_path)
    assert spec.name == "gpt_oss" and fields["num_experts"] == 4 and fields["rope_truncate"] is False


def test_gathered_path_equals_the_loop_and_never_syncs():
    """The CUDA path without grouped GEMM (float32, odd widths: what CUDA graphs capture) gathers each row's
    expert matrices instead of splitting on the host (``counts.tolist()``): the same outputs as the loop,
    padded rows zero."""
    ours, _ = _pair(seed=2, h=32, inter=12)
    experts = ours.experts
    rows = torch.randn(11, 32)
    counts = torch.tensor([3, 0, 4, 1, 0, 2])  # 10 real rows sorted by expert, one padded row at the end
    scale = torch.rand(11)
    loop = experts(rows, counts, True, scale)
    gathered = experts.gathered(rows, counts, True, scale)
    assert rel_err(gathered[:10], loop[:10]) < 1e-6
    assert torch.equal(gathered[10], torch.zeros(32))
