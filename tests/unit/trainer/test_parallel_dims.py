"""ParallelDims (rank layout, groups, the tp * ep * dp check) and the
parallel degrees read from the config (the plan refuses the same mistakes first)."""
from __future__ import annotations

import pytest
import torch

from launcher.plan import build_plan
from tests.conftest import compose, plan_error
from workers.trainer.loop import parallel_degrees
from workers.trainer.parallel.dims import ParallelDims


def dims(rank: int = 0, *, world: int = 8, tp: int = 2, ep: int = 2) -> ParallelDims:
    return ParallelDims(rank=rank, world_size=world, dp=world // (tp * ep), tp=tp, ep=ep, backend="gloo",
                        device=torch.device("cpu"))


def test_rank_layout_is_tp_innermost_then_ep_then_dp():
    d = dims()
    assert d.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.group_ranks("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.group_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert d.group_ranks("batch") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert d.group_ranks("mp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    coords = [(r.dp_rank, r.ep_rank, r.tp_rank, r.batch_rank) for r in (dims(i) for i in range(8))]
    assert coords == [(0, 0, 0, 0), (0, 0, 1, 0), (0, 1, 0, 1), (0, 1, 1, 1),
                      (1, 0, 0, 2), (1, 0, 1, 2), (1, 1, 0, 3), (1, 1, 1, 3)]
    assert d.num_batch_shards == 4  # TP peers share rows; EP and DP ranks each take their own


def test_degrees_that_do_not_make_the_world_name_the_numbers():
    with pytest.raises(ValueError, match=r"tp\(2\) \* ep\(2\) \* dp\(1\) = 4 != trainer world size\(8\)"):
        ParallelDims(rank=0, world_size=8, dp=1, tp=2, ep=2, backend="gloo", device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"trainer ep\(0\) must be >= 1"):
        ParallelDims(rank=0, world_size=1, dp=1, ep=0, backend="gloo", device=torch.device("cpu"))


def test_bare_dims_collectives_are_noops():
    d = ParallelDims(rank=0, world_size=1, dp=1, backend="gloo", device=torch.device("cpu"))
    t = torch.tensor([1.0, 2.0])
    assert d.all_reduce(t, group="mp") is t and t.tolist() == [1.0, 2.0]
    p = torch.nn.Parameter(torch.ones(2))
    d.all_reduce_grads([p], group="dp")
    assert p.grad is not None and p.grad.abs().sum() == 0  # unused parameters get zero grads


def test_parallel_degrees_come_from_trainer_parallel():
    """One check (ParallelConfig.resolve) serves the plan and the ranks: same numbers, same message."""
    cfg = compose(["trainer.num_ranks=4", "trainer.parallel.tp=2", "trainer.parallel.ep=2"])
    assert parallel_degrees(cfg) == (2, 2, 1)
    bad = compose(["trainer.num_ranks=4", "trainer.parallel.pp=2"])
    with pytest.raises(ValueError, match=r"pp\(2\) > 1: the trainer has no pipeline parallelism"):
        parallel_degrees(bad)
    # the plan refuses the same mistakes before anything starts, with the numbers
    msg = plan_error(["trainer.num_ranks=4", "trainer.parallel.tp=2", "trainer.parallel.ep=2", "trainer.parallel.dp=2"])
    assert "trainer.parallel: tp(2) * pp(1) * ep(2) * dp(2) = 8 != trainer.num_ranks(4)" in msg
    assert "trainer.parallel.pp(2) > 1" in plan_error(["trainer.num_ranks=4", "trainer.parallel.pp=2"])
    assert "trainer dims: tp(2) x pp(1) x ep(2) x dp(1) = 4 ranks" in "\n".join(
        build_plan(compose(["trainer.num_ranks=4", "trainer.parallel.tp=2", "trainer.parallel.ep=2"])).summary())
    assert "must divide model.num_experts(8)" in plan_error(["trainer.num_ranks=3", "trainer.parallel.ep=3"])
    summary = "\n".join(build_plan(compose(  # selective works on the mesh plan
        ["trainer.num_ranks=2", "trainer.parallel.ep=2", "trainer.activation_checkpointing=selective"])).summary())
    assert "trainer.activation_checkpointing" not in summary
    assert "EP dispatch: fixed capacity 2x (no host sync per MoE block" in summary  # the default
    assert "EP dispatch: exact split sizes" in "\n".join(build_plan(compose(
        ["trainer.num_ranks=2", "trainer.parallel.ep=2", "trainer.parallel.ep_capacity_factor=0"])).summary())
    assert "ep_capacity_factor must be in [1, 1024] or 0, got 0.5" in plan_error(  # below 1: every step overflows
        ["trainer.num_ranks=2", "trainer.parallel.ep=2", "trainer.parallel.ep_capacity_factor=0.5"])
    assert "must divide model.num_kv_heads(2)" in plan_error(
        ["model=qwen3_moe_tiny", "trainer.num_ranks=4", "trainer.parallel.tp=4", "model.num_heads=4", "model.num_kv_heads=2"])



def test_cp_sits_between_tp_and_ep_and_shares_rows():
    """rank = ((dp * ep + ep_rank) * cp + cp_rank) * tp + tp_rank: cp peers hold the same rows
    (one batch shard), are all in ``batch`` (distinct tokens) and exchange through ``cp``."""
    d = ParallelDims(rank=0, world_size=8, dp=2, cp=2, tp=2, backend="gloo", device=torch.device("cpu"))
    assert d.group_ranks("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.group_ranks("batch") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert d.group_ranks("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]  # expert replicas: their cp ranks too
    assert d.group_ranks("mp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    fsdp = [ParallelDims(rank=r, world_size=4, dp=2, cp=2, backend="gloo", device=torch.device("cpu")) for r in range(4)]
    assert [(x.dp_rank, x.cp_rank, x.batch_rank) for x in fsdp] == [(0, 0, 0), (0, 1, 0), (1, 0, 1), (1, 1, 1)]
    assert fsdp[0].num_batch_shards == 2
    with pytest.raises(ValueError, match=r"tp\(1\) \* cp\(2\) \* ep\(1\) \* dp\(1\) = 2 != trainer world size\(4\)"):
        ParallelDims(rank=0, world_size=4, dp=1, cp=2, backend="gloo", device=torch.device("cpu"))


def test_context_parallel_layouts_the_trainer_cannot_run_are_refused_at_plan_time():
    """cp must divide the Mamba-2 heads (Ulysses; attention with too few heads gathers keys and values
    instead) and the sequence, with token-level ratios, under the FSDP or the mesh plan; the messages
    name the keys and the numbers."""
    assert parallel_degrees(compose(["trainer.num_ranks=4", "trainer.parallel.cp=2"])) == (1, 1, 2)
    summary = "\n".join(build_plan(compose(["trainer.num_ranks=4", "trainer.parallel.cp=2"])).summary())
    assert "tp(1) x pp(1) x ep(1) x cp(2) x dp(2) = 4 ranks" in summary
    # fewer attention heads than cp: keys/values gathered instead of heads split (no refusal)
    assert "cp(8)" in "\n".join(build_plan(compose(["trainer.num_ranks=8", "trainer.parallel.cp=8"])).summary())
    assert "must divide model.mamba_num_heads(6)" in plan_error(
        ["model=nemotron_h_tiny", "model.mamba_num_heads=6", "model.mamba_n_groups=2", "trainer.num_ranks=4",
         "trainer.parallel.cp=4", "trainer.router_replay=false"])
    nemotron_cp2 = ["model=nemotron_h_tiny", "trainer.num_ranks=2", "trainer.parallel.cp=2", "trainer.router_replay=false"]
    assert "does not restart its state at each packed sample" in plan_error([*nemotron_cp2, "trainer.pack_sequences=true"])
    assert "cp(2)" in "\n".join(build_plan(compose(nemotron_cp2)).summary())  # unpacked: runs
    assert "must divide the sequence, model.max_position_embeddings(30)" in plan_error(
        ["model.max_position_embeddings=30", "trainer.num_ranks=4", "trainer.parallel.cp=4"])
    # cp with tp / ep: a dimension of the mesh plan (tests/integration/test_context_parallel_mesh.py)
    mesh = build_plan(compose(["model=qwen3_moe_tiny", "trainer.num_ranks=8", "trainer.parallel.cp=2",
                               "trainer.parallel.tp=2", "trainer.parallel.ep=2"]))
    assert "tp(2) x pp(1) x ep(2) x cp(2) x dp(1) = 8 ranks" in "\n".join(mesh.summary())
    assert mesh.trainer_dims.plan == "mesh"
    assert "ratio_level='sequence' with trainer.parallel.cp(2)" in plan_error(
        ["trainer.num_ranks=2", "trainer.parallel.cp=2", "trainer.ratio_level=sequence"])
    assert "trainer.parallel.cp must be in [1, 1024], got 0" in plan_error(["trainer.parallel.cp=0"])
