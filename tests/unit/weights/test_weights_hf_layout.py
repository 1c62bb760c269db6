"""Published steps are Hugging Face directories (workers/weights/filesystem/hf_layout.py):
``AutoModelForCausalLM.from_pretrained(step_dir)`` loads full and delta steps with no missing or
unexpected keys and computes our model's logits; resolve.py makes a delta step self-contained;
a family without a config.json (tiny_moe) publishes as before."""
from __future__ import annotations

import json

import pytest
import torch

from tests.models.hf_dirs import llama_dir
from workers.common.protocol import STABLE
from workers.models.hf_dir import model_fields
from workers.models.llama.config import LlamaConfig
from workers.models.tiny_moe.config import TinyMoeConfig
from workers.models.tiny_moe.model import init
from workers.weights.base import SoloPeers
from workers.weights.filesystem.hf_layout import hf_files
from workers.weights.filesystem.layout import INDEX
from workers.weights.filesystem.publisher import FilesystemPublisher
from workers.weights.filesystem.resolve import main as resolve_main

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return llama_dir(tmp_path_factory.mktemp("src") / "ckpt", tokenizer_vocab=100)


def cfg_of(directory) -> LlamaConfig:
    return LlamaConfig(name="t", path=str(directory), **model_fields(directory)[1])


def hf_load(step_dir):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(step_dir, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


@torch.no_grad()
def assert_same_function(hf_model, ours):
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]])
    a, b = hf_model(input_ids=ids).logits, ours(ids).logits
    assert (a - b).abs().max() <= 1e-5 * b.abs().max(), (a - b).abs().max()


def publish(root, cfg, states, **kw):
    pub = FilesystemPublisher(root, peers=SoloPeers(), keep_last=10, hf=hf_files(cfg), **kw)
    try:
        for v, st in enumerate(states):
            pub.publish(v, st)
    finally:
        pub.close()


def test_every_full_step_is_a_transformers_directory(source, tmp_path):
    cfg = cfg_of(source)
    ours = init(cfg, torch.float32).eval()
    publish(tmp_path, cfg, [ours.state_dict()])
    step = tmp_path / "step_000000"
    files = sorted(p.name for p in step.iterdir())
    assert files == sorted([STABLE, INDEX, "config.json", "model.safetensors", "model.safetensors.index.json",
                            "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"])
    config = json.loads((step / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    assert model_fields(step)[1] == model_fields(source)[1]  # config.json round-trips through our mapping
    index = json.loads((step / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(ours.state_dict()) and set(index["weight_map"].values()) == {"model.safetensors"}
    assert_same_function(hf_load(step), ours)
    tok = transformers.AutoTokenizer.from_pretrained(step)
    assert len(tok) == 100 and tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False) == "hello"


def test_a_step_written_by_two_ranks_loads_through_the_hf_index(source, tmp_path):
    from tests.unit.weights.test_weights_filesystem import publish_with_ranks

    cfg = cfg_of(source)
    ours = init(cfg, torch.float32).eval()
    publish_with_ranks(tmp_path, 0, ours.state_dict(), world=2, hf=hf_files(cfg))
    step = tmp_path / "step_000000"
    weight_map = json.loads((step / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(weight_map.values()) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert not (step / "model.safetensors").exists()
    assert_same_function(hf_load(step), ours)


def test_delta_steps_load_in_transformers_and_resolve_into_full_dirs(source, tmp_path):
    cfg = cfg_of(source)
    ours = init(cfg, torch.float32).eval()
    states, st = [], ours.state_dict()
    for v in range(3):  # only layer 0 trains: later steps are deltas pointing at step 0 for the rest
        st = {k: (t + 0.01 * v if ".layers.0." in k else t) for k, t in st.items()}
        states.append(st)
    publish(tmp_path / "w", cfg, states, delta=True, full_every=10)
    step = tmp_path / "w" / "step_000002"
    weight_map = json.loads((step / "model.safetensors.index.json").read_text())["weight_map"]
    assert weight_map["model.norm.weight"] == "../step_000000/model-00001-of-00001.safetensors"
    assert not (step / "model.safetensors").exists()  # transformers would prefer it over the index
    ours.load_state_dict(states[2])
    assert_same_function(hf_load(step), ours)
    assert resolve_main([str(step), str(tmp_path / "full")]) == 0
    full = tmp_path / "full"
    assert {p.name for p in full.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert set(json.loads((full / "model.safetensors.index.json").read_text())["weight_map"].values()) == \
        {"model.safetensors"}
    assert_same_function(hf_load(full), ours)


def test_a_family_without_config_json_publishes_plain_safetensors(tmp_path):
    cfg = TinyMoeConfig(name="t", vocab_size=16, hidden_size=32, num_layers=1, num_heads=4, num_experts=2, top_k=1,
                        expert_intermediate_size=16)
    assert hf_files(cfg) is None
    publish(tmp_path, cfg, [init(cfg, torch.float32).state_dict()])
    assert sorted(p.name for p in (tmp_path / "step_000000").iterdir()) == [STABLE, INDEX, "model.safetensors"]


def test_published_config_drops_the_mtp_layers_it_does_not_hold():
    from workers.models.deepseek_v3.config import DeepseekV3Config
    from workers.weights.filesystem.hf_layout import published_config

    cfg = DeepseekV3Config(name="t", vocab_size=8, kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=4,
                           v_head_dim=4, num_mtp_layers=1)
    published = hf_files(cfg).config
    assert published["num_nextn_predict_layers"] == 0 and published["architectures"] == ["DeepseekV3ForCausalLM"]
    assert published_config({"a": 1, "num_nextn_predict_layers": 0}) == {"a": 1, "num_nextn_predict_layers": 0}
