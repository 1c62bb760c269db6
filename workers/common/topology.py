"""Where am I and where are my peers: the ONLY module that reads SLURM_* / RANK / MASTER_* env.

Every role calls :func:`current_topology` once and passes the result around. Two sources:

- local backend: the launcher exports ``SLURMRL_*`` variables for each child it spawns
  (role, rank, worker URLs, trainer master address; with SGLang the router URL and the weight
  group's address, ports laid out as in a Slurm job) plus torchrun-style RANK/WORLD_SIZE.
- Slurm (``SLURMRL_LAYOUT`` set inside a Slurm job): the sbatch script exports the static
  layout of the job (written by the plan, no bash arithmetic) and this module combines it
  with what Slurm knows at run time:

  ``SLURMRL_LAYOUT``  ``role:het_group:num_tasks:num_tasks_per_node:num_nodes_per_replica`` per
                      role, space separated, in het-group order, e.g.
                      ``orchestrator:0:1:1:1 inference:1:2:1:1 trainer:2:1:1:1``.
  ``SLURMRL_PORT_MIN`` / ``SLURMRL_PORT_SPAN`` / ``SLURMRL_NUM_PORT_SLOTS``: the port space;
                      job J uses ``port_min + (J % slots) * span`` onwards (:func:`port_base`).
  ``SLURMRL_NODE_ADDRESS``: node name -> address pattern (``{node}``, ``{node}-ib``, ``127.0.0.1``).
  Slurm:              SLURM_JOB_ID (the hetjob leader's id, the same in every group),
                      SLURM_PROCID / SLURM_NTASKS (per het group), SLURM_JOB_NODELIST_HET_GROUP_K
                      (every group's hosts), SLURMD_NODENAME, SLURM_RESTART_COUNT.

Tasks are laid out in block order (``srun --distribution=block``): task t of a role runs on
node ``t // num_tasks_per_node`` of its group. Server replica j spans tasks
``j*n .. j*n+n-1`` (n = num_nodes_per_replica); its head task serves HTTP.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Mapping, Optional

# Port offsets inside a job's range (the plan checks that the range is large enough).
PORT_MASTER = 0
"""Trainer rendezvous (torch.distributed TCP store, MASTER_PORT)."""
PORT_ROUTER = 1
"""Router HTTP (sglang-router)."""
PORT_WEIGHTS = 2
"""Weight-broadcast group master (trainer rank 0 + every inference rank)."""
PORT_ROUTER_METRICS = 3
"""The router's Prometheus metrics (smg's default, 0.0.0.0:29000, collides between jobs on a node)."""
PORT_SERVERS = 8
"""Server i (prefill, then decode, or unified workers): HTTP at +8+2i, dist-init at +9+2i."""
SERVER_ROLES = ("inference", "prefill", "decode")


def port_base(job_id: int, *, port_min: int, port_span: int, num_port_slots: int) -> int:
    """First port of job ``job_id``: consecutive job ids get disjoint ranges."""
    return port_min + (job_id % num_port_slots) * port_span


def server_ports(base: int, server_index: int) -> tuple[int, int]:
    """(HTTP port, multi-node dist-init port) of the job's server number ``server_index``."""
    return base + PORT_SERVERS + 2 * server_index, base + PORT_SERVERS + 2 * server_index + 1


_RANGE = re.compile(r"\[([^\]]*)\]")


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm host list (``node[1-3,5],gpu-a[01-02]b``) into names, in Slurm's order.

    Zero padding is kept (``[01-02]`` -> 01, 02); several bracket groups in one name expand
    as a cartesian product, left to right. Pure string work: no ``scontrol`` needed.
    """
    hosts: list[str] = []
    for item in _split_top_level(hostlist.strip()):
        hosts.extend(_expand_one(item))
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {text!r}")
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError(f"unbalanced '[' in host list {text!r}")
    items.append(cur)
    return [i for i in (x.strip() for x in items) if i]


def _expand_one(item: str) -> list[str]:
    m = _RANGE.search(item)
    if not m:
        return [item]
    head, tail = item[: m.start()], item[m.end():]
    out = []
    for part in m.group(1).split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"bad range {part!r} in host list item {item!r}")
        width = len(lo) if lo.startswith("0") or (hi and len(lo) == len(hi)) else 0
        for n in range(int(lo), int(hi or lo) + 1):
            out.extend(_expand_one(f"{head}{n:0{width}d}{tail}"))
    return out


def node_address(node: str, pattern: str) -> str:
    """Address peers use to reach ``node``: ``pattern`` with ``{node}`` replaced."""
    return pattern.replace("{node}", node)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoleLayout:
    """One role's static placement, as the plan wrote it into SLURMRL_LAYOUT."""

    role: str
    het_group: int
    num_tasks: int
    num_tasks_per_node: int
    num_nodes_per_replica: int = 1

    def node_index(self, task: int) -> int:
        return task // self.num_tasks_per_node

    @property
    def num_replicas(self) -> int:
        return self.num_tasks // self.num_nodes_per_replica


def format_layout(roles: list[RoleLayout]) -> str:
    return " ".join(f"{r.role}:{r.het_group}:{r.num_tasks}:{r.num_tasks_per_node}:{r.num_nodes_per_replica}"
                    for r in roles)


def parse_layout(text: str) -> dict[str, RoleLayout]:
    roles = {}
    for item in text.split():
        parts = item.split(":")
        if len(parts) != 5 or not all(p.isdigit() for p in parts[1:]):
            raise RuntimeError(f"SLURMRL_LAYOUT item {item!r} is not role:group:tasks:tasks_per_node:nodes_per_replica")
        role, group, tasks, tpn, npr = parts[0], *map(int, parts[1:])
        roles[role] = RoleLayout(role=role, het_group=group, num_tasks=tasks, num_tasks_per_node=tpn,
                                 num_nodes_per_replica=npr)
    return roles


@dataclasses.dataclass(frozen=True, kw_only=True)
class Topology:
    role: str
    """orchestrator | inference | prefill | decode | trainer | router."""
    rank: int
    """Rank inside the role (trainer: torch.distributed rank; inference: worker index)."""
    world_size: int
    """Processes of this role."""
    run_dir: str
    inference_urls: tuple[str, ...]
    """Base URLs of every inference server (prefill, then decode, or unified workers), in order."""
    bind_host: str
    """Address this process's server binds to."""
    bind_port: Optional[int]
    """Port this process serves on (inference servers' head tasks), else None."""
    master_addr: str
    """Trainer rendezvous host (torch.distributed TCP store)."""
    master_port: int
    """Trainer rendezvous port."""
    slurm_job_id: Optional[str] = None
    prefill_urls: tuple[str, ...] = ()
    """Prefill servers (disaggregated inference), a prefix of inference_urls."""
    decode_urls: tuple[str, ...] = ()
    """Decode servers (disaggregated inference), after the prefill ones in inference_urls."""
    router_url: Optional[str] = None
    """sglang-router's URL when the job has a router component."""
    weights_group_addr: Optional[str] = None
    """``host:port`` of the weight-broadcast group master (trainer rank 0's node)."""
    replica: int = 0
    """Server roles: which replica this task belongs to."""
    node_rank: int = 0
    """Server roles: this task's node inside its replica (SGLang --node-rank); 0 serves HTTP."""
    num_nodes_per_replica: int = 1
    """Server roles: nodes of one replica (SGLang --nnodes)."""
    dist_init_addr: Optional[str] = None
    """Server roles: ``host:port`` of the replica's head node (SGLang --dist-init-addr)."""
    het_group: Optional[int] = None
    """Slurm het group of this role."""
    nodename: Optional[str] = None
    """Slurm node this task runs on."""
    restart_count: int = 0
    """How often Slurm requeued this job (0 on the first run): > 0 means resume."""


def _need(env: Mapping[str, str], key: str) -> str:
    if key not in env:
        raise RuntimeError(f"environment variable {key} is not set: this process must be started by the slurmrl launcher "
                           f"or its sbatch script")
    return env[key]


def current_topology(env: Optional[Mapping[str, str]] = None) -> Topology:
    env = os.environ if env is None else env
    if "SLURMRL_LAYOUT" in env and "SLURMRL_LOCAL" not in env:
        return slurm_topology(env)
    role = _need(env, "SLURMRL_ROLE")
    if "SLURM_PROCID" in env and "SLURMRL_LOCAL" not in env:
        rank, world = int(env["SLURM_PROCID"]), int(env.get("SLURM_NTASKS", "1"))
    else:
        rank, world = int(env.get("RANK", env.get("SLURMRL_RANK", "0"))), int(env.get("WORLD_SIZE", "1"))
    urls = tuple(u for u in env.get("SLURMRL_INFERENCE_URLS", "").split(",") if u)
    port, dist_init = None, None
    bind_host = env.get("SLURMRL_BIND_HOST", "127.0.0.1")
    if role == "inference":
        if not urls:
            raise RuntimeError("SLURMRL_INFERENCE_URLS is empty: an inference worker needs its own URL")
        if rank >= len(urls):
            raise RuntimeError(f"inference rank {rank} has no URL: SLURMRL_INFERENCE_URLS lists {len(urls)} workers")
        port = int(urls[rank].rsplit(":", 1)[1])
        dist_init = f"{bind_host}:{port + 1}"  # the HTTP port's neighbour, as server_ports lays them out
    return Topology(
        role=role,
        rank=rank,
        world_size=world,
        run_dir=_need(env, "SLURMRL_RUN_DIR"),
        inference_urls=urls,
        bind_host=bind_host,
        bind_port=port,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT", "29500")),
        slurm_job_id=env.get("SLURM_JOB_ID"),
        router_url=env.get("SLURMRL_ROUTER_URL") or None,
        weights_group_addr=env.get("SLURMRL_WEIGHTS_GROUP_ADDR") or None,
        replica=rank if role == "inference" else 0,
        dist_init_addr=dist_init,
    )


def slurm_topology(env: Mapping[str, str]) -> Topology:
    """Topology of a task of the slurmrl hetjob (see the module docstring for the inputs)."""
    role = _need(env, "SLURMRL_ROLE")
    layout = parse_layout(_need(env, "SLURMRL_LAYOUT"))
    if role not in layout:
        raise RuntimeError(f"SLURMRL_ROLE={role!r} is not in SLURMRL_LAYOUT ({sorted(layout)})")
    me = layout[role]
    rank, world = int(_need(env, "SLURM_PROCID")), int(_need(env, "SLURM_NTASKS"))
    if world != me.num_tasks:
        raise RuntimeError(f"{role}: SLURM_NTASKS={world} but the plan laid out {me.num_tasks} tasks "
                           f"(was the srun line of het group {me.het_group} edited?)")
    job_id = int(_need(env, "SLURM_JOB_ID"))
    base = port_base(job_id, port_min=int(_need(env, "SLURMRL_PORT_MIN")),
                     port_span=int(_need(env, "SLURMRL_PORT_SPAN")),
                     num_port_slots=int(_need(env, "SLURMRL_NUM_PORT_SLOTS")))
    pattern = env.get("SLURMRL_NODE_ADDRESS", "{node}")

    def hosts(r: RoleLayout) -> list[str]:
        key = f"SLURM_JOB_NODELIST_HET_GROUP_{r.het_group}"
        if key not in env and len({x.het_group for x in layout.values()}) == 1:
            key = "SLURM_JOB_NODELIST"  # a one-component job (an admin template without hetjob)
        names = expand_hostlist(_need(env, key))
        need = r.node_index(r.num_tasks - 1) + 1
        if len(names) < need:
            raise RuntimeError(f"{r.role} (het group {r.het_group}) needs {need} nodes, {key} lists {len(names)}: {names}")
        return names

    def addr(r: RoleLayout, task: int) -> str:
        return node_address(hosts(r)[r.node_index(task)], pattern)

    servers = [r for r in layout.values() if r.role in SERVER_ROLES]
    urls: dict[str, list[str]] = {}
    index = 0  # global server number across server roles, in layout order
    my_server = None
    for r in servers:
        urls[r.role] = []
        for j in range(r.num_replicas):
            http, dist = server_ports(base, index)
            head = j * r.num_nodes_per_replica
            urls[r.role].append(f"http://{addr(r, head)}:{http}")
            if r.role == role and head <= rank < head + r.num_nodes_per_replica:
                my_server = (j, rank - head, http, f"{addr(r, head)}:{dist}")
            index += 1
    own_node = hosts(me)[me.node_index(rank)]
    nodename = env.get("SLURMD_NODENAME")
    if nodename and nodename != own_node:
        raise RuntimeError(f"{role}[{rank}] runs on {nodename} but block layout puts it on {own_node}: the srun "
                           f"line must keep --distribution=block and --ntasks-per-node={me.num_tasks_per_node}")
    trainer = layout.get("trainer")
    router = layout.get("router")
    master_addr = addr(trainer, 0) if trainer else "127.0.0.1"
    replica, node_rank, bind_port, dist_init = 0, 0, None, None
    if my_server is not None:
        replica, node_rank, http, dist_init = my_server
        bind_port = http if node_rank == 0 else None
    return Topology(
        role=role,
        rank=rank,
        world_size=world,
        run_dir=_need(env, "SLURMRL_RUN_DIR"),
        inference_urls=tuple(u for r in servers for u in urls[r.role]),
        bind_host=node_address(own_node, pattern),
        bind_port=bind_port,
        master_addr=master_addr,
        master_port=base + PORT_MASTER,
        slurm_job_id=str(job_id),
        prefill_urls=tuple(urls.get("prefill", ())),
        decode_urls=tuple(urls.get("decode", ())),
        router_url=f"http://{addr(router, 0)}:{base + PORT_ROUTER}" if router else None,
        weights_group_addr=f"{master_addr}:{base + PORT_WEIGHTS}" if trainer else None,
        replica=replica,
        node_rank=node_rank,
        num_nodes_per_replica=me.num_nodes_per_replica,
        dist_init_addr=dist_init,
        het_group=me.het_group,
        nodename=nodename,
        restart_count=int(env.get("SLURM_RESTART_COUNT", "0")),
    )
