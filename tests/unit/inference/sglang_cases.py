"""Every SGLang command line a preset produces, built the way a Slurm task builds it.

Shared by the SGLang unit tests: for each preset, the plan's layout is turned into the
environment Slurm would give each task (SLURMRL_LAYOUT from the renderer, per-group node
lists, SLURM_PROCID), workers/common/topology.py reads it, and workers/inference/sglang/server.py
and workers/inference/sglang/router.py build the argv. So the tests check the real path from
config to command line, for every task of every role, not a hand-made placement.
"""
from __future__ import annotations

import dataclasses
import functools

from launcher.plan import JobPlan, build_plan
from launcher.render import layout_of
from tests.conftest import compose
from workers.common.config import RunConfig
from workers.common.topology import Topology, current_topology, port_base
from workers.inference.sglang import server as sglang_server
from workers.inference.sglang import router as router_argv

PRESETS = {
    "glm5_swe_28xh200": ["experiment=glm5_swe_28xh200", "cluster=h200_ib"],
    "kimi_k2_swe_32xh200": ["experiment=kimi_k2_swe_32xh200"],
    "nemotron3_ultra_pd_20xh200": ["experiment=nemotron3_ultra_pd_20xh200"],
    "inference_sglang": ["inference=sglang", "cluster=h200_ib"],
    "inference_sglang_pd": ["inference=sglang_pd", "cluster=h200_ib", "orchestrator.return_routed_experts=false"],
    "inference_sglang_lora": ["inference=sglang", "cluster=h200_ib", "trainer.lora.rank=16"],
    "inference_sglang_adapters": ["inference=sglang", "cluster=h200_ib", "env=mix", "trainer.lora.rank=16",
                                  "trainer.lr=1e-4", "trainer.lora.targets=[attention]",
                                  "trainer.lora.adapters=[short,long]"],
}
"""Every SGLang config of the tree (experiments, and the inference group files on a GPU cluster)."""
JOB_ID = 4242
API_KEY = "test-token"


@dataclasses.dataclass(frozen=True)
class Task:
    role: str
    rank: int
    topo: Topology
    argv: list[str]
    env: dict[str, str]


def slurm_env(cfg: RunConfig, plan: JobPlan, role: str, rank: int) -> dict[str, str]:
    """The environment Slurm + the rendered prologue give task ``rank`` of ``role``."""
    env = {"SLURMRL_ROLE": role, "SLURMRL_LAYOUT": layout_of(plan), "SLURMRL_RUN_DIR": "/run",
           "SLURMRL_PORT_MIN": str(cfg.cluster.port_min), "SLURMRL_PORT_SPAN": str(cfg.cluster.port_span),
           "SLURMRL_NUM_PORT_SLOTS": str(cfg.cluster.num_port_slots), "SLURMRL_NODE_ADDRESS": "{node}",
           "SLURM_JOB_ID": str(JOB_ID), "SLURM_PROCID": str(rank),
           "SLURM_NTASKS": str(plan.role(role).num_procs)}
    for c in plan.components:
        env[f"SLURM_JOB_NODELIST_HET_GROUP_{c.index}"] = f"{c.name}[1-{c.num_nodes}]"
    return env


def build(name: str) -> tuple[RunConfig, JobPlan]:
    """A fresh config and its plan (callers may change the config)."""
    cfg = compose(PRESETS[name])
    return cfg, build_plan(cfg)


@functools.lru_cache(maxsize=None)
def server_tasks(name: str) -> tuple[Task, ...]:
    cfg, plan = build(name)
    out = []
    for r in plan.roles:
        if r.server is None:
            continue
        for rank in range(r.num_procs):
            topo = current_topology(slurm_env(cfg, plan, r.role, rank))
            argv, env = sglang_server.command(cfg, topo, python="python")
            out.append(Task(r.role, rank, topo, argv, env))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def router_task(name: str) -> Task:
    cfg, plan = build(name)
    topo = current_topology(slurm_env(cfg, plan, "router", 0))
    return Task("router", 0, topo, router_argv.command(cfg, topo, python="python"), {})


def job_ports(name: str) -> range:
    cfg, _ = build(name)
    c = cfg.cluster
    base = port_base(JOB_ID, port_min=c.port_min, port_span=c.port_span, num_port_slots=c.num_port_slots)
    return range(base, base + c.port_span)


def value(argv: list[str], name: str):
    """The value after ``--name`` (None when absent, True for a switch)."""
    if name not in argv:
        return None
    i = argv.index(name)
    return argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else True


LOCAL_NODE = ["inference=sglang_node", "inference.num_workers=2", "inference.worker.tp=2", "trainer.num_ranks=2",
              "inference.sglang.model_path=/models/x"]
"""SGLang on one 8-GPU node without Slurm (cluster=local): two tp2 servers beside two trainer ranks."""


@functools.lru_cache(maxsize=None)
def local_tasks() -> tuple[tuple[Task, ...], Task]:
    """(server tasks, router task) of :data:`LOCAL_NODE`, from the environment the local backend
    gives each process (launcher/local_backend.py role_envs), read back by topology.py as the
    processes do."""
    from launcher.gpus import LocalGPUs
    from launcher.local_backend import LocalBackend
    from workers.common.protocol import RunPaths

    cfg = compose(LOCAL_NODE)
    plan = build_plan(cfg, gpus=LocalGPUs(tuple(str(i) for i in range(8)), "NVML"))
    envs = LocalBackend(cfg, plan, RunPaths("/run")).role_envs()
    servers = []
    for rank, env in enumerate(envs["inference"]):
        topo = current_topology(env)
        argv, extra = sglang_server.command(cfg, topo, python="python")
        servers.append(Task("inference", rank, topo, argv, {**env, **extra}))
    topo = current_topology(envs["router"][0])
    return tuple(servers), Task("router", 0, topo, router_argv.command(cfg, topo, python="python"), envs["router"][0])
