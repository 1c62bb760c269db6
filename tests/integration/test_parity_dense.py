"""Parity of the parallel trainer on a DENSE model (grouped-query attention, tied embeddings):
the trainer's plan for each layout (the mesh plan with tp: DTensor TP splits query and kv heads and
the SwiGLU MLP, the tied embedding stays replicated; DP splits rows); each layout, as real gloo
processes, must compute the one-process step (loss, grad norm, every gradient, the weights
after AdamW). The reference is the plain model with the loss functions called directly.
A Qwen3 with ``attention_bias`` (q/k/v biases split with their heads, o_proj's replicated), per-head
q/k norms, an untied vocab-parallel head and a sliding window on one layer runs at tp 2 too, and
once more with GPT-OSS's attention sinks added to its layers (one logit per head, sharded with the heads).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers.netutil import gloo_dims, run_ranks
from workers.common.config import TrainerConfig
from workers.models.llama.config import LlamaConfig
from workers.models.qwen3.config import Qwen3Config
from workers.trainer.batch import RolloutBatch, shard_rows
from workers.trainer.loss import policy_loss, token_logprobs
from workers.common.registry import MODELS
from workers.trainer.parallel import plans
from workers.trainer.step import backward_step

CFG = LlamaConfig(vocab_size=15, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    dense_intermediate_size=48, tie_word_embeddings=True, max_position_embeddings=32)
QWEN3 = Qwen3Config(name="t", vocab_size=15, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=12,
                    dense_intermediate_size=48, attention_bias=True, sliding_window=3,
                    layer_types=["sliding_attention", "full_attention"], max_position_embeddings=32)
CONFIGS = {"llama": CFG, "qwen3": QWEN3, "qwen3+sinks": QWEN3}
SEED = 3


def build_model(cfg, seed: int, sinks: bool = False):
    model = MODELS.get(cfg.family).build(cfg).init_weights(seed)
    if sinks:  # no family of this branch has them: added the way Attention(sinks=True) holds them
        g = torch.Generator().manual_seed(seed)
        for layer in model.model.layers:
            layer.self_attn.sinks = torch.nn.Parameter(torch.randn(cfg.num_heads, generator=g))
    return model
TCFG = TrainerConfig(lr=1e-2, grad_clip=0.05, router_replay=False)


def make_batch(rows: int = 8, length: int = 10) -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, length + 1, (rows,), generator=g)
    attn = torch.arange(length)[None] < lengths[:, None]
    loss = attn & (torch.arange(length)[None] >= torch.randint(2, 4, (rows, 1), generator=g))
    ids = torch.randint(0, CFG.vocab_size, (rows, length), generator=g) * attn
    logp = torch.where(loss, -torch.log(torch.tensor(15.0)) + 0.3 * torch.randn(rows, length, generator=g), 0.0)
    return RolloutBatch(input_ids=ids, attention_mask=attn, loss_mask=loss, inference_logprobs=logp.float(),
                        advantages=torch.randn(rows, length, generator=g) * loss, rewards=torch.zeros(rows),
                        token_versions=torch.zeros(rows, length, dtype=torch.int32), routed_experts=None,
                        routed_mask=None, meta={"temperature": 0.9, "step": 0})


def reference(cfg=CFG, sinks: bool = False) -> dict:
    model, batch = build_model(cfg, SEED, sinks), make_batch()
    logp, _ = token_logprobs(model(batch.input_ids, attention_mask=batch.attention_mask).logits, batch.input_ids,
                             batch.temperature)
    loss, _ = policy_loss(logp, batch.inference_logprobs, batch.advantages, batch.loss_mask,
                          num_loss_tokens=float(batch.loss_mask.sum()), ratio_cap=TCFG.ratio_cap,
                          ratio_mask_low=TCFG.ratio_mask_low, ratio_mask_high=TCFG.ratio_mask_high)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), TCFG.grad_clip))
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), lr=TCFG.lr, betas=tuple(TCFG.betas)).step()
    return {"loss": loss.item(), "grad_norm": norm, "grads": grads, "weights": model.state_dict()}


def _worker(rank: int, world: int, port: int, tp: int, out: str, cfg=CFG, sinks: bool = False) -> None:
    torch.set_num_threads(1)
    dims = gloo_dims(rank, world, port, tp=tp)
    try:
        model = plans.shard(MODELS.get(cfg.family), build_model(cfg, SEED, sinks), dims)  # the trainer's plan for tp
        stats = backward_step(model, shard_rows(make_batch(), dims.batch_rank, dims.num_batch_shards), TCFG, dims)
        grads = model.full_grad_dict()
        torch.optim.AdamW(model.parameters(), lr=TCFG.lr, betas=tuple(TCFG.betas)).step()
        weights = model.full_state_dict()
        if rank == 0:
            torch.save({"stats": stats, "grads": grads, "weights": weights}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("model,tp,dp", [("llama", 1, 1), ("llama", 2, 1), ("llama", 1, 2), ("llama", 2, 2),
                                         ("qwen3", 2, 1), ("qwen3+sinks", 2, 1)])
def test_dense_layout_matches_one_process_reference(tmp_path, model, tp, dp):
    torch.set_num_threads(1)
    cfg = CONFIGS[model]
    sinks = model.endswith("+sinks")
    ref = reference(cfg, sinks)
    out = str(tmp_path / "got.pt")
    run_ranks(_worker, tp * dp, (tp, out, cfg, sinks), what=f"dense {model} layout tp {tp} dp {dp}")
    got = torch.load(out)
    assert "expert_load_max" not in got["stats"] and got["stats"]["aux_loss"] == 0.0
    assert got["stats"]["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
    assert got["stats"]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert list(got["grads"]) == list(ref["grads"]) and ("lm_head.weight" in got["grads"]) == (cfg is QWEN3)
    for name, g in ref["grads"].items():
        err = float((got["grads"][name] - g).abs().max())
        assert err <= 1e-6 + 1e-4 * float(g.abs().max()), f"{name}: grad differs by {err:.3g}"
    for name, w in ref["weights"].items():
        err = float((got["weights"][name] - w).abs().max())
        assert err < 1e-5, f"{name}: weights after AdamW differ by {err:.3g}"
