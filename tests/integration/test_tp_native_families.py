"""Tensor parallelism of the native families of issue 43 under the mesh plan, on real gloo groups.

Each family's tiny checkpoint is built by transformers (its own config class, e.g. GptOssConfig, from
our ``to_hf_config``, biases, sinks and norms drawn at random so each counts) and loaded into our
model. World 1 is that plain model; world 2 is two forked gloo ranks sharding the same weights with
the trainer's plan for the layout (workers/trainer/parallel/plans.py ``shard``), each running the same rows.
Both compute the same loss through the trainer's log-prob path (``target_logprobs``: vocab-parallel
under tp with an untied head) and the test compares the full logits (gathered over the vocabulary
shards) and every parameter's full gradient by checkpoint name (``full_grad_dict``).

What tp = 2 exercises: heads split with q/k/v biases (GPT-OSS), o_proj row-parallel with its bias
added once, per-head sinks split with the heads, Gemma's ``(1 + w)`` q/k norms replicated with a
TP-summed gradient, Gemma's scaled embedding vocab-parallel (untied config) and the tied head kept
replicated, the MLP / GPT-OSS experts (tokens split over tp, experts replicated; Router Replay
forces the routing so rounding cannot flip a top-k choice). The dense families ride the same plan:
qwen3 (RMSNorm q/k norms, untied head), qwen2 (q/k/v biases), mistral (sliding window).
GPT-OSS's ep > 1: tests/integration/test_gpt_oss_expert_parallel.py.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from tests.helpers.netutil import gloo_dims, run_ranks
from tests.models.parity import hf_reference, load_into
from workers.common.registry import MODELS
from workers.models.gemma3_text.config import Gemma3TextConfig
from workers.models.gpt_oss.config import GptOssConfig
from workers.models.layer_types import FULL, SLIDING
from workers.models.mistral.config import MistralConfig
from workers.models.qwen2.config import Qwen2Config
from workers.models.qwen3.config import Qwen3Config
from workers.trainer.parallel.plans import shard
from workers.trainer.parallel.tensor import vocab_parallel_target_logprobs

GEMMA = Gemma3TextConfig(name="t", vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=16, dense_intermediate_size=48, query_pre_attn_scalar=20, sliding_window=4,
                         layer_types=[SLIDING, FULL], rope_theta=1000.0, rope_local_base_freq=50.0,
                         max_position_embeddings=64, tie_word_embeddings=True)
GPT_OSS = GptOssConfig(name="t", vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=16, num_experts=4, top_k=2, expert_intermediate_size=32, sliding_window=4,
                       layer_types=[SLIDING, FULL], rope_theta=10000.0, rope_scaling="yarn", rope_factor=4.0,
                       rope_original_max_position_embeddings=16, rope_truncate=False, swiglu_limit=0.5,
                       max_position_embeddings=64)
DENSE = dict(name="t", vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
             dense_intermediate_size=48, max_position_embeddings=64, tie_word_embeddings=False)
CONFIGS = {"gemma3-tied": GEMMA, "gemma3-untied": dataclasses.replace(GEMMA, tie_word_embeddings=False),
           "gpt_oss": GPT_OSS, "qwen3": Qwen3Config(**DENSE), "qwen2": Qwen2Config(**DENSE),
           "mistral": MistralConfig(**DENSE, sliding_window=4)}
ROWS, LENGTH, TEMPERATURE = 3, 9, 0.9


def _randomise(hf) -> None:
    """Non-trivial norms (Gemma's are offsets from 0), biases and sinks; bigger experts so the clamps act."""
    for name, p in hf.named_parameters():
        if name.endswith(("norm.weight", "bias", "sinks")):
            p.copy_(0.3 * torch.randn_like(p))
        elif "experts" in name:
            p.mul_(10.0)


def _inputs(cfg, rows: int = ROWS) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, cfg.vocab_size, (rows, LENGTH), generator=g)
    out = {"input_ids": ids, "weights": torch.randn(rows, LENGTH - 1, generator=g)}
    if cfg.family == "gpt_oss":  # Router Replay: the same routing on every layout, whatever the rounding
        out["forced_experts"] = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:cfg.top_k]
                                             for _ in range(rows * LENGTH * cfg.num_layers)]).view(
            rows, LENGTH, cfg.num_layers, cfg.top_k)
    return out


def _loss(model, logits: torch.Tensor, inputs: dict) -> torch.Tensor:
    """A weighted sum of next-token log-probs through the model's own (maybe vocab-parallel) path."""
    flat = logits[:, :-1].reshape(-1, logits.shape[-1])
    targets = inputs["input_ids"][:, 1:].reshape(-1)
    if hasattr(model, "target_logprobs"):
        logp, _ = model.target_logprobs(flat, targets, TEMPERATURE)
    else:
        logp, _ = vocab_parallel_target_logprobs(flat, targets, TEMPERATURE, vocab_start=0, group=None)
    return -(logp * inputs["weights"].reshape(-1)).sum()


def _forward(model, inputs: dict) -> torch.Tensor:
    kw = {"forced_experts": inputs["forced_experts"]} if "forced_experts" in inputs else {}
    return model(inputs["input_ids"], **kw).logits


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    """(config, transformers-built checkpoint directory, world-1 logits and gradients)."""
    cfg = CONFIGS[request.param]
    spec = MODELS.get(cfg.family)
    from transformers import CONFIG_MAPPING

    hf_config = spec.to_hf_config(cfg)
    _, directory = hf_reference(CONFIG_MAPPING[hf_config["model_type"]](**hf_config),
                                tmp_path_factory.mktemp(request.param), prepare=_randomise)
    torch.manual_seed(0)
    model = load_into(spec.build(cfg), directory).train()
    inputs = _inputs(cfg)
    logits = _forward(model, inputs)
    _loss(model, logits, inputs).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return cfg, directory, logits.detach(), grads


def _worker(rank, world, port, cfg, directory, out):
    """One tp rank: the same rows as the reference, this rank's shard of the same weights."""
    dims = gloo_dims(rank, world, port, tp=world)
    try:
        spec = MODELS.get(cfg.family)
        model = shard(spec, load_into(spec.build(cfg), directory).train(), dims)
        inputs = _inputs(cfg)
        logits = _forward(model, inputs)
        _loss(model, logits, inputs).backward()
        parts = [None] * world
        dist.all_gather_object(parts, logits.detach())  # the vocabulary shards of the tp ranks
        grads = model.full_grad_dict()
        if rank == 0:
            full = torch.cat(parts, dim=-1) if getattr(model, "vocab_sharded", False) else parts[0]
            torch.save({"logits": full, "grads": grads, "plan": type(model).__name__}, out)
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_2_matches_one_process(checkpoint, tmp_path):
    cfg, directory, logits, grads = checkpoint
    out = str(tmp_path / "got.pt")
    run_ranks(_worker, 2, (cfg, directory, out), what=f"{cfg.family} tp2", timeout_s=240)
    got = torch.load(out)
    assert got["plan"].startswith("Mesh"), got["plan"]
    assert got["logits"].shape == logits.shape
    torch.testing.assert_close(got["logits"], logits, rtol=1e-5, atol=1e-5)
    assert list(got["grads"]) == list(grads), "full_grad_dict: checkpoint names, in the model's order"
    for name, g in grads.items():
        err = float((got["grads"][name] - g).abs().max())
        assert err <= 1e-6 + 1e-4 * float(g.abs().max()), f"{name}: gradient differs by {err:.3g}"

