"""Published steps of a byte-level model carry tokenizer files (workers/weights/filesystem/
byte_tokenizer.py): AutoTokenizer loads them, its chat template gives the very ids the run's
env used (envs/chat.py ChatTemplate), and model + tokenizer from the step directory can be prompted."""
from __future__ import annotations

import pytest

from tests.conftest import compose
from workers.orchestrator.envs.chat import EOT, ChatTemplate
from workers.weights.filesystem.hf_layout import hf_files

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo wörld 3+4= <x>\n"},
            {"role": "assistant", "content": "7"}, {"role": "tool", "content": "ok"}]


def step_dir(tmp_path, *overrides):
    hf = hf_files(compose(["model=tiny_dense", *overrides]).model)
    hf.write(tmp_path, {}, 0, "float32")
    return tmp_path, hf


def test_byte_level_model_steps_get_a_tokenizer_that_matches_the_run(tmp_path):
    transformers = pytest.importorskip("transformers")
    d, hf = step_dir(tmp_path, "model.vocab_size=264")
    assert {name for name, _ in hf.generated} == {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert ids == ChatTemplate().prompt_ids(MESSAGES)
    assert tok.eos_token_id == EOT and tok.decode(ChatTemplate().tok.encode("héllo") + [EOT],
                                                  skip_special_tokens=True) == "héllo"


def test_small_vocabulary_models_get_no_byte_tokenizer(tmp_path):
    d, hf = step_dir(tmp_path)  # tiny_dense: vocab 16, reverse_digits' own ids
    assert hf.generated == () and not (d / "tokenizer.json").exists()


def test_model_and_tokenizer_from_a_step_directory_can_be_prompted(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    d, hf = step_dir(tmp_path, "model.vocab_size=264")
    config = transformers.AutoConfig.for_model(**{k: v for k, v in hf.config.items() if k != "model_type"},
                                               model_type=hf.config["model_type"])
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(d)  # what a published step holds
    model = transformers.AutoModelForCausalLM.from_pretrained(str(d))
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    prompt = tok.apply_chat_template(MESSAGES[:2], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=4, do_sample=False, eos_token_id=tok.eos_token_id)
    assert out.shape[1] > prompt["input_ids"].shape[1] and isinstance(tok.decode(out[0]), str)
