"""workers/common/topology.py on Slurm: host lists, ports from the job id, peers of every role.

The environments below are what Slurm 22.05 sets in a hetjob task (see tests/slurm/README.md)
plus the SLURMRL_* layout the sbatch prologue exports.
"""
from __future__ import annotations

import pytest

from workers.common.topology import (RoleLayout, current_topology, expand_hostlist, format_layout, parse_layout,
                                     port_base, server_ports)


@pytest.mark.parametrize("hostlist, hosts", [
    ("node1", ["node1"]),
    ("node[1-4]", ["node1", "node2", "node3", "node4"]),
    ("node[1-2,4]", ["node1", "node2", "node4"]),
    ("gpu[008-011]", ["gpu008", "gpu009", "gpu010", "gpu011"]),
    ("a[1-2],b3,c[09-10]", ["a1", "a2", "b3", "c09", "c10"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("h200-[0-1]-ib", ["h200-0-ib", "h200-1-ib"]),
    (" node[9-11] ", ["node9", "node10", "node11"]),
])
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["node[1-2", "node1-2]", "node[a-b]"])
def test_expand_hostlist_rejects_garbage(bad):
    with pytest.raises(ValueError):
        expand_hostlist(bad)


def test_ports_are_disjoint_for_consecutive_jobs():
    kw = dict(port_min=20000, port_span=64, num_port_slots=150)
    bases = [port_base(j, **kw) for j in range(1000, 1150)]
    assert len(set(bases)) == 150 and min(bases) >= 20000 and max(bases) + 64 <= 20000 + 150 * 64
    assert server_ports(20000, 3) == (20014, 20015)


def test_layout_round_trips():
    roles = [RoleLayout(role="orchestrator", het_group=0, num_tasks=1, num_tasks_per_node=1),
             RoleLayout(role="prefill", het_group=1, num_tasks=4, num_tasks_per_node=1, num_nodes_per_replica=2)]
    assert list(parse_layout(format_layout(roles)).values()) == roles


def slurm_env(role: str, procid: int, layout: str, nodelists: list[str], ntasks: int, **extra) -> dict[str, str]:
    env = {"SLURMRL_ROLE": role, "SLURMRL_RUN_DIR": "/runs/x", "SLURMRL_LAYOUT": layout,
           "SLURMRL_PORT_MIN": "20000", "SLURMRL_PORT_SPAN": "64", "SLURMRL_NUM_PORT_SLOTS": "150",
           "SLURMRL_NODE_ADDRESS": "{node}", "SLURM_JOB_ID": "23", "SLURM_PROCID": str(procid),
           "SLURM_NTASKS": str(ntasks), "SLURM_HET_SIZE": str(len(nodelists))}
    env.update({f"SLURM_JOB_NODELIST_HET_GROUP_{k}": v for k, v in enumerate(nodelists)})
    env.update(extra)
    return env


TINY = "orchestrator:0:1:1:1 inference:1:2:1:1 trainer:2:1:1:1"
TINY_NODES = ["node1", "node[2-3]", "node4"]
BASE = 20000 + (23 % 150) * 64  # 21472


def test_tiny_orchestrator_finds_every_worker():
    t = current_topology(slurm_env("orchestrator", 0, TINY, TINY_NODES, 1))
    assert t.inference_urls == (f"http://node2:{BASE + 8}", f"http://node3:{BASE + 10}")
    assert (t.master_addr, t.master_port, t.router_url, t.het_group) == ("node4", BASE, None, 0)
    assert t.bind_port is None and t.slurm_job_id == "23"


def test_tiny_inference_worker_binds_its_own_url():
    t = current_topology(slurm_env("inference", 1, TINY, TINY_NODES, 2, SLURMD_NODENAME="node3"))
    assert (t.rank, t.world_size, t.bind_host, t.bind_port) == (1, 2, "node3", BASE + 10)
    assert t.inference_urls[t.rank] == f"http://{t.bind_host}:{t.bind_port}"


def test_local_cluster_addresses_are_all_loopback():
    env = slurm_env("trainer", 0, TINY, TINY_NODES, 1, SLURMRL_NODE_ADDRESS="127.0.0.1", SLURM_RESTART_COUNT="1")
    t = current_topology(env)
    assert (t.master_addr, t.bind_host, t.restart_count) == ("127.0.0.1", "127.0.0.1", 1)
    assert all(u.startswith("http://127.0.0.1:") for u in t.inference_urls) and len(set(t.inference_urls)) == 2


GLM = ("orchestrator:0:1:2:1 router:0:1:2:1 prefill:1:4:1:2 decode:2:8:1:4 trainer:3:128:8:1")
GLM_NODES = ["cpu1", "g[001-004]", "g[005-012]", "g[013-028]"]


def test_disaggregated_servers_and_multi_node_replicas():
    orch = current_topology(slurm_env("orchestrator", 0, GLM, GLM_NODES, 1))
    assert orch.prefill_urls == (f"http://g001:{BASE + 8}", f"http://g003:{BASE + 10}")
    assert orch.decode_urls == (f"http://g005:{BASE + 12}", f"http://g009:{BASE + 14}")
    assert orch.inference_urls == orch.prefill_urls + orch.decode_urls
    assert orch.router_url == f"http://cpu1:{BASE + 1}" and orch.master_addr == "g013"
    assert orch.weights_group_addr == f"g013:{BASE + 2}"
    # Task 6 of decode = replica 1, its third node; only the head task (node_rank 0) serves HTTP.
    d = current_topology(slurm_env("decode", 6, GLM, GLM_NODES, 8, SLURMD_NODENAME="g011"))
    assert (d.replica, d.node_rank, d.num_nodes_per_replica, d.bind_port) == (1, 2, 4, None)
    assert d.dist_init_addr == f"g009:{BASE + 15}"
    head = current_topology(slurm_env("decode", 4, GLM, GLM_NODES, 8))
    assert (head.replica, head.node_rank, head.bind_port) == (1, 0, BASE + 14)
    tr = current_topology(slurm_env("trainer", 77, GLM, GLM_NODES, 128, SLURMD_NODENAME="g022"))
    assert (tr.rank, tr.world_size, tr.bind_host) == (77, 128, "g022")


@pytest.mark.parametrize("change, message", [
    ({"SLURM_NTASKS": "3"}, "SLURM_NTASKS=3 but the plan laid out 2 tasks"),
    ({"SLURMRL_ROLE": "critic"}, "SLURMRL_ROLE='critic' is not in SLURMRL_LAYOUT"),
    ({"SLURMD_NODENAME": "node2"}, "runs on node2 but block layout puts it on node3"),
    ({"SLURM_JOB_NODELIST_HET_GROUP_1": "node2"}, "needs 2 nodes"),
    ({"SLURMRL_LAYOUT": "inference:1:2"}, "is not role:group:tasks:tasks_per_node:nodes_per_replica"),
])
def test_errors_name_the_problem(change, message):
    env = slurm_env("inference", 1, TINY, TINY_NODES, 2, SLURMD_NODENAME="node3")
    env.update(change)
    with pytest.raises(RuntimeError, match=message):
        current_topology(env)


def test_missing_variable_is_named():
    env = slurm_env("inference", 0, TINY, TINY_NODES, 2)
    del env["SLURMRL_PORT_SPAN"]
    with pytest.raises(RuntimeError, match="SLURMRL_PORT_SPAN is not set"):
        current_topology(env)


def test_local_backend_environment_is_unchanged():
    env = {"SLURMRL_ROLE": "inference", "SLURMRL_RUN_DIR": "/r", "SLURMRL_LOCAL": "1", "RANK": "1", "WORLD_SIZE": "2",
           "SLURMRL_INFERENCE_URLS": "http://127.0.0.1:5001,http://127.0.0.1:5002", "MASTER_PORT": "6000"}
    t = current_topology(env)
    assert (t.rank, t.world_size, t.bind_port, t.master_port, t.het_group) == (1, 2, 5002, 6000, None)
