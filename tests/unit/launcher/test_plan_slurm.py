"""Slurm placement in build_plan: components, node counts, parallel dims, ports, and errors
that name the key with the numbers (launcher/plan.py, launcher/resources.py)."""
from __future__ import annotations


import pytest

from launcher.config_store import register
from tests.conftest import TINY_SLURM, GLM5, plan, plan_error

register()


def test_tiny_local_slurm_is_three_components():
    p = plan(TINY_SLURM)
    assert [(c.index, c.name, c.roles, c.num_nodes) for c in p.components] == [
        (0, "control", ("orchestrator",), 1), (1, "inference", ("inference",), 2), (2, "trainer", ("trainer",), 1)]
    assert [r.role for r in p.roles] == ["trainer", "inference", "orchestrator"]  # local start order kept
    assert p.role("inference").num_procs == 2 and p.role("inference").num_tasks_per_node == 1
    assert {r.role: r.main for r in p.roles} == {"trainer": True, "inference": False, "orchestrator": True}
    assert not any(r.role == "router" for r in p.roles)
    assert p.num_gpu_nodes == 0


def test_glm5_plan_adds_up_to_28_gpu_nodes():
    p = plan(GLM5)
    gpu = {c.name: c.num_nodes for c in p.components if c.num_gpus_per_node}
    assert gpu == {"prefill": 4, "decode": 8, "trainer": 16}
    assert sum(gpu.values()) == 28 == p.num_gpu_nodes
    # control_placement=trainer: orchestrator + router on the trainer's first node, no 29th node
    assert p.components[-1].roles == ("trainer", "orchestrator", "router") and len(p.components) == 3
    assert {c.partition for c in p.components} == {"h200"}
    d = p.trainer_dims
    assert (d.tp, d.pp, d.ep, d.cp, d.dp, d.num_ranks) == (1, 1, 8, 16, 1, 128)
    assert abs(p.params.total - 744e9) / 744e9 < 0.01  # published: 744B
    assert 35e9 < p.params.active < 45e9  # published: ~40B active
    assert {m.what for m in p.memory} == {"trainer", "prefill", "decode"}
    assert all(m.fits for m in p.memory if m.what != "trainer")
    # one 131072-token episode over 16 cp ranks fits: 8192 tokens/GPU, the DSA indexer on its memory-linear
    # path (query chunks; the dense reference would score every (query, key) pair: 2.3 TB at 131k)
    (trainer,) = [m for m in p.memory if m.what == "trainer"]
    assert trainer.fits and "8192 tokens/GPU (131072 per forward / cp 16)" in trainer.detail
    assert "DSA indexer 11.0 GB (query chunks of 256, top 2048 keys each)" in trainer.detail and not d.warnings
    prefill, decode = p.role("prefill"), p.role("decode")
    assert (prefill.num_procs, prefill.num_nodes_per_replica, prefill.num_replicas) == (4, 2, 2)
    assert (decode.num_procs, decode.num_nodes_per_replica, decode.num_replicas) == (8, 4, 2)
    assert "GPU nodes: prefill 4 + decode 8 + trainer 16 = 28" in "\n".join(p.summary())


def test_parallel_dims_mismatch_prints_the_numbers():
    msg = plan_error([*GLM5, "trainer.parallel.dp=4"])
    assert "trainer.parallel: tp(1) * pp(1) * ep(8) * cp(16) * dp(4) = 512 != trainer.num_ranks(128)" in msg
    msg = plan_error([*TINY_SLURM, "trainer.parallel.tp=3"])
    assert "does not divide trainer.num_ranks(1)" in msg


def test_dp_is_derived():
    p = plan([*TINY_SLURM, "trainer.num_ranks=2"])
    assert (p.trainer_dims.dp, p.role("trainer").num_tasks_per_node) == (2, 2)


@pytest.mark.parametrize("overrides, key", [
    (["trainer.num_ranks=3", "trainer.parallel.ep=3"], "trainer.parallel.ep(3) must divide model.num_experts(8)"),
    ([*GLM5, "trainer.num_ranks=120"], "trainer.num_ranks(120) != launcher.trainer.num_nodes(16) x cluster.num_gpus_per_node(8)"),
    ([*GLM5, "launcher.num_gpu_nodes=32"], "launcher.num_gpu_nodes(32) != GPU nodes planned: prefill(4) + decode(8) + trainer(16) = 28"),
    ([*GLM5, "inference.prefill.tp=8"], "inference.prefill.tp(8) must equal the GPUs of one replica"),
    ([*GLM5, "inference.decode.ep=24"], "inference.decode.ep(24) must divide inference.decode.tp(32)"),
    ([*GLM5, "inference.num_workers=2"], "inference.num_workers(2) must be 0 with prefill/decode replicas"),
    ([*GLM5, "trainer.parallel.tp=16", "trainer.parallel.cp=1", "trainer.parallel.dp=1"], "trainer.parallel.tp(16) > cluster.num_gpus_per_node(8)"),
    ([*GLM5, "launcher.trainer.num_nodes=8", "trainer.num_ranks=64", "trainer.parallel.cp=8", "trainer.parallel.dp=1",
      "launcher.num_gpu_nodes=0"], "trainer does not fit"),
    ([*TINY_SLURM, "inference.num_prefill_replicas=1", "inference.num_decode_replicas=1", "inference.num_workers=0"],
     "need inference.backend=sglang"),
    ([*TINY_SLURM, "inference.worker.tp=2"], "inference.worker: inference.backend=embedded is one CPU process"),
    ([*TINY_SLURM, "inference.num_workers=3", "inference.worker.num_replicas_per_node=2"],
     "inference.num_workers(3) must be a multiple of inference.worker.num_replicas_per_node(2)"),
    ([*TINY_SLURM, "trainer.num_ranks=8"], "cluster.num_cpus_per_node(4)"),
    ([*TINY_SLURM, "cluster.time_limit=1h"], "cluster.time_limit='1h'"),
    ([*TINY_SLURM, "cluster.port_span=8"], "cluster.port_span(8) < 12 ports"),
    ([*TINY_SLURM, "cluster.port_min=60000"], "cluster.port_min(60000)"),
    ([*TINY_SLURM, "cluster.backend=nope"], "cluster.backend='nope' is not supported; choose one of ['local', 'slurm']"),
])
def test_bad_input_names_the_key(overrides, key):
    assert key in plan_error(overrides)


def test_local_backend_ignores_node_fit():
    # Eight trainer ranks on this machine are the local backend's business, not Slurm's 4-CPU nodes.
    assert plan(["trainer.num_ranks=8"]).role("trainer").num_procs == 8


def test_small_trainer_on_a_gpu_cluster_uses_part_of_a_node():
    p = plan(["cluster=h200_ib"])  # tiny_local: one trainer rank
    assert (p.role("trainer").num_procs, p.role("trainer").num_gpus_per_node) == (1, 1)
    assert p.role("inference").num_gpus_per_node == 0  # embedded workers are CPU processes
    assert p.components[1].partition == "cpu"


def test_plan_is_deterministic():
    assert plan(GLM5) == plan(GLM5)
