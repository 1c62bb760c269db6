"""The FSDP plan and the trainer step know only ``CausalLM``: a MoE whose router is the sigmoid
grouped top-k router (workers/models/blocks/router_sigmoid.py, as DeepSeek-V3 / Kimi / GLM-5 /
Nemotron-H use it) and whose MoE block has no ``route`` of its own trains the same at dp 2 with
micro-batches and selective activation checkpointing as at dp 1 in one pass, Router Replay on.

The model is tiny_moe's skeleton with every MoE block swapped for :class:`SigmoidMoe` (a block
calling ``gate.route``), so the trainer finds the router by its ``route`` method, not by name.
"""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.integration import test_parity_parallel as moe
from tests.helpers.netutil import gloo_dims, run_ranks
from workers.models.blocks.router_sigmoid import SigmoidTopkRouter
from workers.models.blocks.experts import StackedExperts
from workers.models.tiny_moe.model import build_model
from workers.models.blocks.moe_softmax import MoeBlock
from workers.trainer.batch import shard_rows
from workers.trainer.parallel.fsdp import parallelize
from workers.trainer.micro import apply_activation_checkpointing
from workers.trainer.step import backward_step


class SigmoidMoe(nn.Module):
    """Experts behind a sigmoid router with grouped top-k and a correction bias."""

    balance = MoeBlock.balance
    _experts_loop = MoeBlock._experts_loop

    def __init__(self, cfg):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.gate = SigmoidTopkRouter(hidden_size=cfg.hidden_size, num_experts=cfg.num_experts, top_k=cfg.top_k,
                                      n_group=2, topk_group=2)
        self.experts = StackedExperts(cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size)

    def forward(self, x, forced, valid, forced_mask=None):
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        idx, weights, probs = self.gate.route(flat, None if forced is None else forced.reshape(-1, self.top_k),
                                              None if forced_mask is None else forced_mask.reshape(-1))
        aux, load = self.balance(idx, probs, valid)
        return self._experts_loop(flat, idx, weights).view(b, t, h), idx.view(b, t, self.top_k), aux, load


def sigmoid_model():
    model = build_model(moe.CFG, moe.SEED)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp = SigmoidMoe(moe.CFG)
            for p in layer.mlp.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(moe.CFG.num_experts, generator=g) * 0.01)
    return model


def _worker(rank, world, port, cfg, out):
    torch.set_num_threads(1)
    dims = gloo_dims(rank, world, port)
    try:
        full = sigmoid_model()
        apply_activation_checkpointing(full.model.layers, cfg.activation_checkpointing)
        model = parallelize(full, dims)
        stats = backward_step(model, shard_rows(moe.make_batch(), dims.batch_rank, dims.num_batch_shards), cfg, dims)
        torch.optim.AdamW(model.parameters(), lr=cfg.lr).step()
        weights = model.full_state_dict()
        if rank == 0:
            torch.save({"stats": stats, "weights": weights}, out)
    finally:
        dist.destroy_process_group()


def run(tmp_path, world, cfg):
    out = str(tmp_path / f"w{world}_{time.monotonic_ns()}.pt")
    run_ranks(_worker, world, (cfg, out), what=f"world {world}")
    return torch.load(out)


def test_sigmoid_router_moe_trains_the_same_sharded_and_micro_batched(tmp_path):
    one = run(tmp_path, 1, moe.tcfg())
    two = run(tmp_path, 2, dataclasses.replace(moe.tcfg(), micro_batch_tokens=16, activation_checkpointing="selective"))
    assert 0 < one["stats"]["routing_disagreement"] < 1, "own sigmoid choices vs the replayed random experts"
    for key in ("loss", "grad_norm", "aux_loss", "routing_disagreement", "expert_load_max_l0", "expert_load_min_l1"):
        assert two["stats"][key] == pytest.approx(one["stats"][key], rel=1e-5, abs=1e-7), key
    assert any(".mlp.gate.weight" in n for n in one["weights"])
    assert any(n.endswith("e_score_correction_bias") for n in one["weights"]), "published with its persistent buffers"
    for name, w in one["weights"].items():
        err = float((two["weights"][name] - w).abs().max())
        assert err < 1e-5, f"{name}: dp 2 differs from dp 1 by {err:.3g}"
