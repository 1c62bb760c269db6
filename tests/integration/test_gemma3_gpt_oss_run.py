"""``slurmrl model.path=DIR`` on a tiny Gemma 3 and a tiny GPT-OSS checkpoint made by transformers
(save_pretrained, a BPE tokenizer trained offline): the launcher takes the family from config.json,
the embedded engine generates with the model (sliding-window layers shorter than the sequences,
GPT-OSS's sinks), the trainer trains it under the FSDP2 plan (Router Replay of
GPT-OSS's experts), and the last published step loads in ``AutoModelForCausalLM.from_pretrained``
with no missing or unexpected keys and computes our model's logits."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers  # the reference every model test imports; `make test` installs it

from benchmarks.gpu.hf_checkpoints import save_tokenizer
from tests.integration.conftest import SMALL, assert_no_children_left, metrics, slurmrl
from workers.common.config.run import load_run_config
from workers.common.registry import MODELS
from workers.weights.filesystem.receiver import DiskReader

TINY = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=256, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
FAMILIES = {  # family -> (HF config class, its extra fields, trainer overrides)
    "gemma3_text": ("Gemma3TextConfig", dict(intermediate_size=64, query_pre_attn_scalar=8), []),
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
                ["trainer.router_replay=true"]),
}


def tiny_dir(directory: Path, family: str) -> Path:
    cls, extra, _ = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, cls)(**TINY, **extra)
    config.architectures = [MODELS.get(family).hf_architectures[0]]
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    save_tokenizer(directory, 100)
    return directory


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_run_starts_from_the_checkpoint_and_publishes_transformers_directories(tmp_path, family):
    source = tiny_dir(tmp_path / f"tiny-{family}", family)
    run_dir = tmp_path / "run"
    slurmrl([*SMALL, f"model.path={source}", "orchestrator.max_off_policy_steps=0", "trainer.num_steps=2",
             "trainer.micro_batch_tokens=256", *FAMILIES[family][2],
             f"launcher.run_dir={run_dir}"], tmp_path)
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == [1, 2]
    assert recs[0]["mismatch_kl"] < 1e-3, recs[0]["mismatch_kl"]  # engine and trainer: the same function
    cfg = load_run_config(str(run_dir / "config" / "run.yaml"))
    assert (cfg.model.family, cfg.model.path) == (family, str(source))
    last = run_dir / "weights" / "step_000002"
    assert json.loads((last / "config.json").read_text())["architectures"] == list(
        MODELS.get(family).hf_architectures)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(last, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ours = MODELS.get(family).build(cfg.model, dtype=torch.float32)
    ours.load_state_dict(DiskReader().load(last).state, strict=True)
    ids = torch.tensor([[5, 3, 9, 1, 2, 14, 7, 7, 11, 12, 3, 4]])  # longer than the 8-key window
    with torch.no_grad():
        a, b = hf.eval()(input_ids=ids).logits, ours.eval()(ids).logits
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    assert_no_children_left(run_dir)
