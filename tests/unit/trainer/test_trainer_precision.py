"""Mixed precision, plan choice and micro-batch splitting of the trainer (issue 19, items 1-3).

The lr=1e-6 update fraction is the reason for float32 master weights: bfloat16 parameters
round almost every AdamW step of that size away. The FSDP plan and the family's TP/EP plan
must both keep float32 parameters and optimizer state while their forward runs in bfloat16.
"""
from __future__ import annotations

import pytest
import torch

from tests.conftest import plan
from tests.helpers.netutil import free_port, gloo_dims
from workers.common.config import TrainerConfig
from workers.common.config.trainer import check_precision
from workers.common.registry import MODELS
from workers.models.spec import FSDP_PLAN, MESH_PLAN
from workers.models.tiny_moe.model import TinyMoeConfig, build_model
from workers.trainer.micro import empty_like, plan_micro_batches, split_micro_batches, take
from workers.trainer.precision import Precision, update_fraction

CFG = TinyMoeConfig(vocab_size=15, hidden_size=32, num_layers=2, num_heads=2, num_experts=4, top_k=2,
                    expert_intermediate_size=32, max_position_embeddings=32)


def test_float32_master_weights_take_the_small_steps_bfloat16_rounds_away():
    f32, bf16 = update_fraction(torch.float32, size=256), update_fraction(torch.bfloat16, size=256)
    assert f32 > 0.99 and bf16 < 0.1, (f32, bf16)


def test_precision_choices_and_the_pure_bf16_warning():
    assert check_precision("bfloat16", "float32") is None and check_precision("float32", "float32") is None
    assert "pure bfloat16" in check_precision("bfloat16", "bfloat16")
    with pytest.raises(ValueError, match="trainer.master_dtype"):
        check_precision("float32", "bfloat16")
    p = plan(["trainer.dtype=bfloat16", "trainer.master_dtype=bfloat16"])
    assert any(line.startswith("WARNING trainer.master_dtype=bfloat16") for line in p.summary())
    assert not any(line.startswith("WARNING") for line in plan(["trainer.dtype=bfloat16"]).summary())


@pytest.mark.parametrize("master,per_param", [("float32", 16), ("bfloat16", 8)])
def test_the_planned_trainer_memory_follows_the_master_dtype(master, per_param):
    p = plan(["experiment=glm5_swe_28xh200", "trainer.dtype=bfloat16", f"trainer.master_dtype={master}"])
    assert any(line.startswith("memory trainer: states") and f"({per_param} B/param x" in line
               for line in p.summary()), p.summary()


def test_tp_ep_one_runs_fsdp_and_tp_ep_the_mesh_plan_for_every_family():
    import dataclasses

    for family in ("tiny_moe", "llama", "qwen3_moe", "deepseek_v3", "glm_moe_dsa", "nemotron_h"):
        assert MODELS.get(family).trainer_plan(1, 1) == FSDP_PLAN
        assert MODELS.get(family).trainer_plan(2, 2) == MODELS.get(family).trainer_plan(1, 4) == MESH_PLAN
    bare = dataclasses.replace(MODELS.get("tiny_moe"), name="bare", parallelize="")  # a plugin opting out
    with pytest.raises(ValueError, match=r"tp\(1\) x ep\(4\).*'bare'"):
        bare.trainer_plan(1, 4)
    assert plan(["trainer.num_ranks=2"]).trainer_dims.plan == FSDP_PLAN
    from launcher.resources import check_trainer_options
    from tests.conftest import compose

    layout = ["model=kimi_k2", "trainer.num_ranks=2", "trainer.parallel.ep=2"]
    for dry in ("false", "true"):  # a real run plans it, a dry run has no warning
        assert check_trainer_options(compose([f"launcher.dry_run={dry}", *layout])) == (MESH_PLAN, ())


def test_micro_batches_hold_the_budget_and_every_rank_runs_as_many():
    assert plan_micro_batches([5, 5, 9, 2, 2, 2], 0, packed=False) == [[0, 1, 2, 3, 4, 5]]
    # padded cost: rows x longest row of the micro-batch
    assert plan_micro_batches([5, 5, 9, 2, 2, 2], 12, packed=False) == [[0, 1], [2], [3, 4, 5]]
    assert plan_micro_batches([5, 5, 9, 2, 2, 2], 12, packed=True) == [[0, 1], [2, 3], [4, 5]]
    assert plan_micro_batches([20, 3], 12, packed=False) == [[0], [1]]  # too long: alone
    from tests.integration.test_parity_parallel import make_batch

    batch = make_batch()
    sub = take(batch, [0, 1])
    assert sub.input_ids.shape[1] == int(sub.attention_mask.sum(1).max())  # cut to the longest row
    micro = split_micro_batches(batch, 24, packed=False, dims=_bare_dims())
    assert sum(m.num_rows for m in micro) == batch.num_rows
    assert all(m.num_rows * m.input_ids.shape[1] <= 24 for m in micro)
    pad = empty_like(batch)
    assert pad.input_ids.shape == (1, 1) and not pad.attention_mask.any() and not pad.loss_mask.any()
    assert pad.routed_experts.shape == (1, 1, CFG.num_layers, CFG.top_k)


def _bare_dims():
    from workers.trainer.parallel.dims import ParallelDims

    return ParallelDims(rank=0, world_size=1, dp=1, backend="gloo", device=torch.device("cpu"))


@pytest.mark.parametrize("plan_name", ["fsdp", "mesh"])
def test_both_plans_keep_float32_state_and_compute_in_bfloat16(plan_name):
    from workers.trainer.parallel import mesh
    from workers.trainer.parallel.fsdp import parallelize
    from workers.trainer.step import train_step
    from tests.integration.test_parity_parallel import make_batch

    tcfg = TrainerConfig(dtype="bfloat16", master_dtype="float32", router_replay=True, lr=1e-6)
    precision = Precision.of(tcfg)
    dims = gloo_dims(0, 1, free_port())
    try:
        full = build_model(CFG, 7)
        before = {n: p.detach().clone() for n, p in full.state_dict().items()}  # checkpoint names, as published
        model = (parallelize(full, dims, precision=precision) if plan_name == "fsdp"
                 else mesh.parallelize(full, dims, precision=precision))
        seen = []
        hook = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        opt = torch.optim.AdamW(model.parameters(), lr=tcfg.lr)
        stats = train_step(model, opt, make_batch(), tcfg, dims)
        hook.remove()
        published = model.full_state_dict(to_rank=None, dtype=precision.compute)
        masters = model.full_state_dict(to_rank=None)
    finally:
        torch.distributed.destroy_process_group()
    assert seen and set(seen) == {torch.bfloat16}, "the forward runs in the compute dtype"
    assert all(p.dtype == torch.float32 for p in model.parameters()), "master weights stay float32"
    assert all(v.dtype == torch.float32 for s in opt.state.values() for k, v in s.items() if k != "step")
    assert all(v.dtype == torch.bfloat16 for v in published.values()), "published in the compute dtype"
    changed = sum(int((masters[n] != w).sum()) for n, w in before.items()) / sum(w.numel() for w in before.values())
    assert changed > 0.9, f"an lr=1e-6 step changed only {changed:.1%} of the float32 master weights"
    assert stats["grad_norm"] > 0


def test_activation_checkpointing_recomputes_each_layer_in_the_backward_and_keeps_the_names():
    from workers.trainer.micro import apply_activation_checkpointing

    model = build_model(CFG, 7)
    names = [n for n, _ in model.named_parameters()]
    apply_activation_checkpointing(model.model.layers, "full")
    assert [n for n, _ in model.named_parameters()] == names, "no wrapper module: HF names unchanged"
    calls = []
    model.model.layers[0].self_attn.register_forward_hook(lambda *a: calls.append(torch.is_grad_enabled()))
    ids = torch.randint(0, CFG.vocab_size, (2, 6))
    model(ids).logits.sum().backward()
    assert len(calls) == 2, "forward once, recomputed once in the backward"
    with pytest.raises(ValueError, match="trainer.activation_checkpointing"):
        apply_activation_checkpointing(model.model.layers, "sometimes")


def test_selective_checkpointing_recomputes_the_cheap_ops_but_no_matmul():
    from torch.utils._python_dispatch import TorchDispatchMode

    from workers.trainer.micro import apply_activation_checkpointing

    mm = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.matmuls = self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            self.matmuls += func in mm
            return func(*args, **(kwargs or {}))

    counts = {}
    for mode in ("none", "full", "selective"):
        model = build_model(CFG, 7)
        apply_activation_checkpointing(model.model.layers, mode)
        with Count() as c:
            model(torch.randint(0, CFG.vocab_size, (2, 12))).logits.sum().backward()
        counts[mode] = (c.matmuls, c.ops)
    assert counts["full"][0] > counts["none"][0], "full recomputes the matmuls"
    assert counts["selective"][0] == counts["none"][0], "selective keeps every matmul output"
    assert counts["selective"][1] > counts["none"][1], "selective recomputes the elementwise ops"


def test_selective_checkpointing_refuses_a_kept_output_changed_in_place():
    """A matmul output kept for the backward, then changed in place in the forward: the recompute
    would hand the changed value to the backward, so it raises instead of training on it."""
    from workers.trainer.micro import apply_activation_checkpointing

    class InPlace(torch.nn.Linear):
        def forward(self, x):
            y = super().forward(x)
            y.mul_(2.0)
            return y.sin()

    layers = torch.nn.ModuleList([InPlace(4, 4), torch.nn.Linear(4, 4)])
    apply_activation_checkpointing(layers, "selective")
    with pytest.raises(RuntimeError, match="changed in place"):
        layers[0](torch.randn(3, 4, requires_grad=True)).sum().backward()
    out = layers[1](torch.randn(3, 4, requires_grad=True))  # out of place: fine
    out.sum().backward()
    assert layers[1].weight.grad is not None
