"""model.path in: the torch-free directory checks (workers/models/hf_dir.py) and the streaming
reader (workers/models/hf_checkpoint.py) on tiny checkpoints saved by transformers, block-FP8
weights against a float reference, slices, and every bad input with its file and key."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models.hf_dirs import llama_dir
from workers.models.hf_checkpoint import HFCheckpoint, check_model_path, load_pretrained
from workers.models.hf_dir import CheckpointError, check_directory, model_fields, weight_map
from workers.models.llama.config import LlamaConfig
from workers.models.tiny_moe.model import build, init


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return llama_dir(tmp_path_factory.mktemp("llama") / "ckpt", tokenizer_vocab=100)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return llama_dir(tmp_path_factory.mktemp("llama") / "ckpt", max_shard_size="20KB")


def cfg_of(directory) -> LlamaConfig:
    spec, fields = model_fields(directory)
    assert spec.name == "llama"
    return LlamaConfig(name="t", path=str(directory), **fields)


def copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def test_config_json_fills_the_llama_fields(hf):
    spec, fields = model_fields(hf)
    assert spec.name == "llama"
    assert fields == dict(vocab_size=128, hidden_size=32, dense_intermediate_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
                          rope_theta=10000.0)
    check_directory(hf, cfg_of(hf))


@pytest.mark.parametrize("which", ["hf", "sharded"])
def test_init_streams_the_checkpoint_into_the_model_exactly(which, request):
    directory = request.getfixturevalue(which)
    files = sorted(set(weight_map(directory).values()))
    assert (len(files) > 1) == (which == "sharded")
    reference = {k: v for f in files for k, v in load_file(str(directory / f)).items()}
    model = init(cfg_of(directory), torch.float32)
    state = model.state_dict()
    assert set(state) == set(reference)
    assert all(torch.equal(state[k], reference[k]) for k in state)
    check_model_path(cfg_of(directory))  # the launcher's header-only check agrees


@pytest.mark.parametrize("kw", [dict(dtype=torch.bfloat16), dict(tie_word_embeddings=True)])
def test_bf16_and_tied_checkpoints_load(kw, tmp_path):
    directory = llama_dir(tmp_path / "ckpt", **kw)
    reference = load_file(str(directory / "model.safetensors"))
    assert ("lm_head.weight" in reference) != kw.get("tie_word_embeddings", False)
    model = init(cfg_of(directory), torch.float32)
    state = model.state_dict()
    assert set(state) == set(reference) and all(torch.equal(state[k], reference[k].float()) for k in state)
    assert cfg_of(directory).tie_word_embeddings == kw.get("tie_word_embeddings", False)


def test_slices_read_only_the_part_asked_for(sharded):
    ckpt = HFCheckpoint(sharded)
    name = "model.layers.1.mlp.up_proj.weight"
    full = ckpt.read(name)
    assert torch.equal(ckpt.read(name, (slice(16, 48),)), full[16:48])
    assert torch.equal(ckpt.read(name, (slice(None), slice(8, 24))), full[:, 8:24])
    # A rank holding rows 32:64 of every up_proj (a TP shard): full shapes checked, halves read.
    cfg = cfg_of(sharded)
    model = build(cfg, device="meta")
    full_shapes = {n: list(t.shape) for n, t in model.state_dict().items()}
    with torch.device("meta"):
        for layer in model.model.layers:
            layer.mlp.up_proj = torch.nn.Linear(32, 32, bias=False)
    load_pretrained(model, cfg, lambda s: s, full_shapes=full_shapes,
                    slices=lambda n: (slice(32, 64),) if n.endswith("up_proj.weight") else None)
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, full[32:64])


def fp8_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``w`` per ``block`` x ``block`` block the DeepSeek-V3 way (scale = amax / 448)."""
    rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
    scale = torch.empty(rows, cols)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = blk.abs().max() / 448.0
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (blk / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def test_fp8_block_weights_are_dequantised_like_a_float_reference(tmp_path):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=gen) * torch.linspace(0.1, 10, 200)  # blocks of different ranges
    q, scale = fp8_blocks(w)
    save_file({"x.weight": q, "x.weight_scale_inv": scale, "y.weight": torch.ones(3)}, str(tmp_path / "model.safetensors"))
    ckpt = HFCheckpoint(tmp_path)
    assert ckpt.names() == ["x.weight", "y.weight"]  # the scale belongs to its weight
    reference = torch.empty_like(w)
    for i in range(300):
        for j in range(200):
            reference[i, j] = float(q[i, j].float()) * float(scale[i // 128, j // 128])
    got = ckpt.read("x.weight")
    assert got.dtype == torch.float32 and torch.equal(got, reference)
    assert (got - w).abs().max() <= 0.07 * w.abs().max()  # and it is the weight, to FP8 precision
    for index in [(slice(100, 290), slice(130, 190)), (slice(5, 6),), (slice(None), slice(127, 129))]:
        assert torch.equal(ckpt.read("x.weight", index), reference[index]), index
    save_file({"x.weight": q}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'x.weight' is float8_e4m3fn but "
                                              r"'x.weight_scale_inv' .* is missing"):
        HFCheckpoint(tmp_path).read("x.weight")
    save_file({"x.weight": q, "x.weight_scale_inv": scale[:, :1].contiguous()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"x.weight_scale_inv' has shape \[3, 1\]; 128x128 blocks .* need \[3, 2\]"):
        HFCheckpoint(tmp_path).read("x.weight")


def edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_bad_directories_are_refused_naming_file_and_key(hf, tmp_path):
    with pytest.raises(CheckpointError, match="model.path=.*nowhere is not a directory"):
        model_fields(tmp_path / "nowhere")
    d = copy(hf, tmp_path)
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"ckpt/config.json: not valid JSON"):
        model_fields(d)
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"ckpt/config.json: no config.json"):
        model_fields(d)
    shutil.copyfile(hf / "config.json", d / "config.json")
    edit_config(d, architectures=["MambaForCausalLM"])
    with pytest.raises(CheckpointError, match=r"config.json: architectures=\['MambaForCausalLM'\] is not supported; "
                                              r"supported architectures: \[.*'LlamaForCausalLM'"):
        model_fields(d)
    edit_config(d, architectures=["LlamaForCausalLM"], attention_bias=True)
    with pytest.raises(CheckpointError, match=r"config.json: attention_bias=True is not implemented by model family llama"):
        model_fields(d)
    edit_config(d, attention_bias=False, sliding_window=64)
    with pytest.raises(CheckpointError, match=r"config.json: key 'sliding_window' \(= .*\) is not implemented by model family llama"):
        model_fields(d)
    edit_config(d, sliding_window=None)
    del_key(d, "sliding_window")
    edit_config(d, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(CheckpointError, match=r"rope_parameters=.*yarn.* is not implemented"):
        model_fields(d)
    edit_config(d, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(CheckpointError, match=r"config.json: quantization_config=.*gptq.* is not supported"):
        model_fields(d)


def del_key(directory, key):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.pop(key, None)
    path.write_text(json.dumps(config))


def test_missing_shards_and_weights_are_refused(sharded, tmp_path):
    d = copy(sharded, tmp_path)
    (d / "model-00002-of-00007.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json: weight_map\['.*'\] names shard "
                                              r"model-00002-of-00007.safetensors, which is missing"):
        weight_map(d)
    for f in d.glob("model*"):
        f.unlink()
    with pytest.raises(CheckpointError, match=r"ckpt: no model.safetensors and no model.safetensors.index.json"):
        weight_map(d)


def test_missing_unexpected_and_misshaped_tensors_name_file_and_key(hf, tmp_path):
    cfg = cfg_of(hf)
    state = load_file(str(hf / "model.safetensors"))
    d = copy(hf, tmp_path)
    cfg.path = str(d)
    cases = {
        "missing": ({k: v for k, v in state.items() if k != "model.norm.weight"},
                    r"ckpt: tensors missing from the checkpoint \(1\): \['model.norm.weight'\]"),
        "unexpected": ({**state, "model.layers.2.mlp.up_proj.weight": torch.zeros(2)},
                       r"ckpt/model.safetensors: tensor 'model.layers.2.mlp.up_proj.weight' is unexpected"),
        "misshaped": ({**state, "model.norm.weight": torch.ones(31)},
                      r"ckpt/model.safetensors: tensor 'model.norm.weight' has shape \[31\]; the model's "
                      r"'model.norm.weight' is \[32\]"),
    }
    for what, (tensors, message) in cases.items():
        save_file(tensors, str(d / "model.safetensors"))
        with pytest.raises(CheckpointError, match=message):
            check_model_path(cfg)  # the launcher's check (headers only)
        with pytest.raises(CheckpointError, match=message):
            init(cfg, torch.float32)  # and the load itself


def test_a_tokenizer_larger_than_the_embedding_is_refused(hf, tmp_path):
    d = copy(hf, tmp_path)
    edit_config(d, vocab_size=64)
    cfg = cfg_of(d)
    with pytest.raises(CheckpointError, match=r"ckpt/tokenizer.json: the tokenizer has 100 token ids but "
                                              r".*ckpt/config.json vocab_size is 64"):
        check_directory(d, cfg)


def test_the_model_section_must_match_config_json(hf):
    cfg = cfg_of(hf)
    cfg.num_layers = 3
    with pytest.raises(CheckpointError, match=r"model.num_layers=3 contradicts .*config.json \(2\)"):
        check_directory(hf, cfg)
