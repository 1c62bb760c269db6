"""Per-role Slurm resources: nodes, tasks per node, CPUs, GPUs, memory, parallel dims.

Split out of plan.py so each file stays readable; everything here is pure and raises
PlanError naming the config key with the numbers involved ("tp(2) * pp(1) * ep(4) * dp(2)
= 16 != trainer ranks(8)"). Fit checks against the node size run only for Slurm: the local
backend runs every role as a process on this machine (its GPUs: launcher/gpus.py).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from launcher.activations import longest_sample
from launcher.run_dir import run_label
from workers.common.config import RunConfig, ServerLayout
from workers.common.config.trainer import check_precision, experts_per_rank
from workers.common.registry import BACKENDS, MODELS


class PlanError(ValueError):
    """The config cannot be planned; the message names the key."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolePlan:
    role: str
    """orchestrator | router | inference | prefill | decode | trainer (SLURMRL_ROLE)."""
    num_procs: int
    """Processes (Slurm tasks) of this role."""
    module: str
    """``python -m`` module that runs one process of the role."""
    het_group: int = 0
    """Slurm het-job component that hosts the role."""
    num_nodes: int = 1
    num_tasks_per_node: int = 1
    num_cpus_per_task: int = 1
    num_gpus_per_node: int = 0
    mem_gb: int = 0
    """Memory per node in GB (0: the cluster default, no --mem flag)."""
    num_nodes_per_replica: int = 1
    """Server roles: nodes of one replica."""
    main: bool = False
    """The job is done when every main role (trainer, orchestrator) exited 0; servers are then stopped."""
    overlap: bool = False
    """Runs on the first node of another role's het group (``srun --overlap``), outside its task count:
    the orchestrator and router with ``launcher.control_placement=trainer``."""
    server: Optional[ServerLayout] = None
    """Server roles: the replica layout (tp / ep / dp_attention)."""
    config_key: str = ""
    """Config section that sizes this role (named in errors)."""
    description: str = ""

    @property
    def num_replicas(self) -> int:
        return self.num_procs // self.num_nodes_per_replica


@dataclasses.dataclass(frozen=True, kw_only=True)
class ComponentPlan:
    """One ``#SBATCH hetjob`` block."""

    index: int
    name: str
    roles: tuple[str, ...]
    num_nodes: int
    num_tasks_per_node: int
    num_cpus_per_task: int
    num_gpus_per_node: int
    mem_gb: int
    partition: Optional[str]
    sbatch_flags: tuple[tuple[str, str], ...] = ()
    """This group's own flags (``cluster.groups.<name>.sbatch_flags``), after the job-wide ones."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerDims:
    tp: int
    pp: int
    ep: int
    dp: int
    num_ranks: int
    num_nodes: int
    num_gpus_per_node: int
    num_experts: int
    cp: int = 1
    """Context-parallel ranks per sequence."""
    plan: str = ""
    """The trainer's sharding plan (``module:callable``): FSDP2 at tp = ep = 1, else the family's own."""
    warnings: tuple[str, ...] = ()
    """Plan-time warnings about the trainer's settings (printed with the plan summary)."""
    ep_capacity_factor: float = 0.0
    """trainer.parallel.ep_capacity_factor: fixed-capacity EP dispatch (> 0) or exact split sizes (0)."""

    def describe(self) -> str:
        where = (f"{self.num_nodes} node(s) x {self.num_gpus_per_node} GPUs" if self.num_gpus_per_node
                 else f"{self.num_nodes} node(s), CPU")
        cp = f" x cp({self.cp})" if self.cp > 1 else ""  # shown only when used (golden sbatch files stay)
        return (f"tp({self.tp}) x pp({self.pp}) x ep({self.ep}){cp} x dp({self.dp}) = {self.num_ranks} ranks on {where}; "
                f"{self.num_experts // self.ep} routed experts per EP rank" + self.describe_dispatch())

    def describe_dispatch(self) -> str:
        """How the EP all-to-alls are sized (workers/trainer/parallel/expert_capacity.py); nothing at ep 1."""
        if self.ep == 1:
            return ""
        if self.ep_capacity_factor > 0:
            return (f"; EP dispatch: fixed capacity {self.ep_capacity_factor:g}x (no host sync per MoE block; a step "
                    f"that overflows is redone exactly)")
        return "; EP dispatch: exact split sizes (one host sync per MoE block and micro-batch)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlurmJobPlan:
    """Job-wide Slurm settings the renderer needs (copied from cluster/launcher config)."""

    job_name: str
    account: Optional[str]
    qos: Optional[str]
    time_limit: str
    signal_grace_s: int
    requeue: bool
    max_requeues: int
    sbatch_flags: tuple[tuple[str, str], ...]
    setup: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    node_address: str
    port_min: int
    port_span: int
    num_port_slots: int
    shutdown_grace_s: int
    template_dir: Optional[str]
    python: Optional[str]
    gpu_mem_whole_node: bool = True
    container_runtime: str = "none"
    container_image: str = ""
    container_mounts: tuple[str, ...] = ()
    container_workdir: str = ""
    server_respawns: int = 0
    respawn_backoff_s: float = 5.0
    respawn_backoff_max_s: float = 60.0

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "SlurmJobPlan":
        c = cfg.cluster
        return cls(job_name=cfg.launcher.job_name or f"slurmrl-{cfg.name or run_label(cfg)}", account=c.account, qos=c.qos, time_limit=c.time_limit,
                   signal_grace_s=c.signal_grace_s, requeue=c.requeue, max_requeues=c.max_requeues,
                   sbatch_flags=tuple(sorted(c.sbatch_flags.items())), setup=tuple(c.setup),
                   env=tuple(sorted(c.env.items())), node_address=c.node_address, port_min=c.port_min,
                   port_span=c.port_span, num_port_slots=c.num_port_slots,
                   shutdown_grace_s=int(round(cfg.launcher.shutdown_grace_s)), template_dir=c.template_dir,
                   python=c.python, gpu_mem_whole_node=c.gpu_mem_whole_node, container_runtime=c.container.runtime,
                   container_image=c.container.image, container_mounts=tuple(c.container.mounts),
                   container_workdir=c.container.workdir, server_respawns=c.server_respawns,
                   respawn_backoff_s=c.respawn_backoff_s, respawn_backoff_max_s=c.respawn_backoff_max_s)


def _check_cpus(cfg: RunConfig, what: str, key: str, tasks_per_node: int, cpus: int) -> None:
    have = cfg.cluster.num_cpus_per_node
    if have and tasks_per_node * cpus > have:
        raise PlanError(f"{what}: {tasks_per_node} tasks/node x {key}({cpus}) CPUs = {tasks_per_node * cpus} > "
                        f"cluster.num_cpus_per_node({have})")


def plan_trainer(cfg: RunConfig, *, check_fit: bool) -> tuple[RolePlan, TrainerDims]:
    lt, ranks, gpn = cfg.launcher.trainer, cfg.trainer.num_ranks, cfg.cluster.num_gpus_per_node
    if gpn and lt.num_nodes == 1 and ranks <= gpn:
        tpn = gpn = ranks  # a small trainer on part of one GPU node
    elif gpn:
        if ranks != lt.num_nodes * gpn:
            raise PlanError(f"trainer.num_ranks({ranks}) != launcher.trainer.num_nodes({lt.num_nodes}) x "
                            f"cluster.num_gpus_per_node({gpn}) = {lt.num_nodes * gpn}: one trainer rank per GPU")
        tpn = gpn
    else:
        if ranks % lt.num_nodes:
            raise PlanError(f"trainer.num_ranks({ranks}) must be a multiple of launcher.trainer.num_nodes({lt.num_nodes})")
        tpn = ranks // lt.num_nodes
    par = cfg.trainer.parallel
    try:
        d = par.resolve(ranks)  # the one check of tp * pp * ep * dp (the trainer ranks call it too)
    except ValueError as e:
        raise PlanError(str(e)) from None
    m = cfg.model
    try:
        experts_per_rank(m.num_experts, par.ep)
    except ValueError as e:
        raise PlanError(str(e)) from None
    if m.num_heads % par.tp:
        raise PlanError(f"trainer.parallel.tp({par.tp}) must divide model.num_heads({m.num_heads})")
    check_context_parallel(cfg)
    for key in ("num_kv_heads", "kv_heads"):  # GQA families: the mesh plan splits KV heads over tp too
        if getattr(m, key, 0) and getattr(m, key) % par.tp:
            raise PlanError(f"trainer.parallel.tp({par.tp}) must divide model.{key}({getattr(m, key)})")
    if gpn and par.tp > gpn:
        raise PlanError(f"trainer.parallel.tp({par.tp}) > cluster.num_gpus_per_node({gpn}): keep tensor parallel "
                        f"inside a node (NVLink)")
    plan, warnings = check_trainer_options(cfg)
    if check_fit:
        _check_cpus(cfg, "trainer", "launcher.trainer.num_cpus_per_task", tpn, lt.num_cpus_per_task)
    dims = TrainerDims(**d, num_ranks=ranks, num_nodes=lt.num_nodes, num_gpus_per_node=gpn,
                       num_experts=m.num_experts, plan=plan, warnings=warnings,
                       ep_capacity_factor=par.ep_capacity_factor)
    role = RolePlan(role="trainer", num_procs=ranks, module="workers.trainer", num_nodes=lt.num_nodes,
                    num_tasks_per_node=tpn, num_cpus_per_task=lt.num_cpus_per_task, num_gpus_per_node=gpn,
                    mem_gb=lt.mem_gb, main=True, config_key="launcher.trainer",
                    description=f"trainer: {ranks} rank(s), {tpn} per node")
    return role, dims


def check_context_parallel(cfg: RunConfig) -> None:
    """``trainer.parallel.cp`` (workers/trainer/parallel/context.py): PlanError naming the numbers for a
    layout the trainer cannot run. Ulysses splits the Mamba-2 scan by heads, so cp must divide
    model.mamba_num_heads (Mamba groups are repeated as needed, so they need not); attention splits
    by heads when cp divides model.num_heads and gathers the keys/values otherwise (no constraint).
    cp must divide the sequence (the longest, model.max_position_embeddings; shorter rows are padded
    to a multiple of cp). With tp/ep > 1 (the mesh plan) the same holds: attention splits its heads
    over tp first and Ulysses splits what is left over cp (or gathers the keys/values when too few
    are left), the Mamba-2 mixers are replicated over tp (all their heads split over cp), and the
    experts' all-to-all carries each cp rank's tokens."""
    par, m, t = cfg.trainer.parallel, cfg.model, cfg.trainer
    if par.cp == 1:
        return
    mamba = getattr(m, "mamba_num_heads", 0) if "M" in getattr(m, "hybrid_override_pattern", "") else 0
    if mamba % par.cp:
        raise PlanError(f"trainer.parallel.cp({par.cp}) must divide model.mamba_num_heads({mamba}): context "
                        f"parallelism splits the Mamba-2 scan's heads over the cp ranks")
    if mamba and t.pack_sequences:
        raise PlanError(f"trainer.pack_sequences=true with trainer.parallel.cp({par.cp}) on a Mamba-2 hybrid: the "
                        f"context-parallel scan (workers/models/blocks/mamba2_cp.py) does not restart its state at "
                        f"each packed sample yet (the cp 1 path does); use pack_sequences=false or cp=1")
    if m.max_position_embeddings % par.cp:
        raise PlanError(f"trainer.parallel.cp({par.cp}) must divide the sequence, model.max_position_embeddings"
                        f"({m.max_position_embeddings}): each cp rank holds an equal contiguous chunk")
    if t.ratio_level != "token":
        raise PlanError(f"trainer.ratio_level={t.ratio_level!r} with trainer.parallel.cp({par.cp}): a row-level "
                        f"ratio needs every token of the row on one rank; use ratio_level=token")


def check_trainer_options(cfg: RunConfig) -> tuple[str, tuple[str, ...]]:
    """The sharding plan the trainer ranks will pick and the warnings; PlanError for what they would refuse:
    a tp/ep layout for a family without its own plan (a warning in a dry run, which plans presets of
    families still being built), a master dtype below the compute dtype, a micro-batch budget that
    cannot hold the longest sample."""
    t, par = cfg.trainer, cfg.trainer.parallel
    warnings = []
    try:
        warning = check_precision(t.dtype, t.master_dtype)
        plan = MODELS.get(cfg.model.family).trainer_plan(par.tp, par.ep)
    except ValueError as e:
        if not (cfg.launcher.dry_run and "ModelSpec.parallelize" in str(e)):
            raise PlanError(str(e)) from None
        plan, warning = "", check_precision(t.dtype, t.master_dtype)  # a dry run plans layouts still to come
        warnings.append(f"{e} (a real run is refused)")
    longest, where = longest_sample(cfg)
    if 0 < t.micro_batch_tokens < longest:
        raise PlanError(f"trainer.micro_batch_tokens({t.micro_batch_tokens}) < the longest sample a run can hold, "
                        f"{where}({longest}): a micro-batch must fit one whole sample; "
                        f"use >= {longest}, or 0 for the whole rank batch in one pass")
    return plan, tuple(warnings) + ((warning,) if warning else ())


def _server_kinds(cfg: RunConfig, backend) -> list[tuple[str, int, ServerLayout, str]]:
    i = cfg.inference
    if i.num_prefill_replicas or i.num_decode_replicas:
        if not backend.supports_disaggregation:
            able = [n for n in BACKENDS.names() if BACKENDS.get(n).supports_disaggregation]
            raise PlanError(f"inference.num_prefill_replicas/num_decode_replicas need inference.backend="
                            f"{'|'.join(able)} (got {i.backend!r}: it serves both phases in one worker)")
        if not (i.num_prefill_replicas > 0 and i.num_decode_replicas > 0):
            raise PlanError(f"prefill/decode disaggregation needs both inference.num_prefill_replicas"
                            f"({i.num_prefill_replicas}) and inference.num_decode_replicas({i.num_decode_replicas}) > 0")
        if i.num_workers:
            raise PlanError(f"inference.num_workers({i.num_workers}) must be 0 with prefill/decode replicas "
                            f"(the unified workers would be a third kind of server)")
        return [("prefill", i.num_prefill_replicas, i.prefill, "inference.prefill"),
                ("decode", i.num_decode_replicas, i.decode, "inference.decode")]
    if i.num_workers <= 0:
        raise PlanError("inference.num_workers must be > 0 (or set inference.num_prefill_replicas and num_decode_replicas)")
    return [("inference", i.num_workers, i.worker, "inference.worker")]


def plan_servers(cfg: RunConfig, backend, *, check_fit: bool) -> list[RolePlan]:
    """Server roles of ``backend`` (its BackendSpec): GPU replicas sized by tp, or one CPU process each."""
    i, gpn_cluster = cfg.inference, cfg.cluster.num_gpus_per_node
    out = []
    for role, num, lay, key in _server_kinds(cfg, backend):
        count_key = "inference.num_workers" if role == "inference" else f"inference.num_{role}_replicas"
        npr, rpn = lay.num_nodes_per_replica, lay.num_replicas_per_node
        if npr > 1 and rpn > 1:
            raise PlanError(f"{key}: num_nodes_per_replica({npr}) and num_replicas_per_node({rpn}) cannot both be > 1")
        if num % rpn:
            raise PlanError(f"{count_key}({num}) must be a multiple of {key}.num_replicas_per_node({rpn})")
        gpn = gpn_cluster if backend.uses_gpus else 0
        if backend.uses_gpus and cfg.cluster.backend == "local":
            gpn = lay.tp  # one node: the servers get GPUs of this machine (launcher/gpus.py places them)
        elif backend.uses_gpus:
            if not gpn_cluster:
                raise PlanError(f"inference.backend={i.backend} needs GPUs: cluster.num_gpus_per_node must be > 0")
            if gpn_cluster % rpn:
                raise PlanError(f"{key}.num_replicas_per_node({rpn}) must divide cluster.num_gpus_per_node({gpn_cluster})")
            replica_gpus = npr * gpn_cluster // rpn
            if lay.tp != replica_gpus:
                raise PlanError(f"{key}.tp({lay.tp}) must equal the GPUs of one replica: num_nodes_per_replica({npr}) "
                                f"x cluster.num_gpus_per_node({gpn_cluster}) / num_replicas_per_node({rpn}) = {replica_gpus}")
        elif (lay.tp, lay.ep, lay.dp_attention, npr) != (1, 1, 1, 1):
            raise PlanError(f"{key}: inference.backend={i.backend} is one CPU process per worker; tp({lay.tp}), "
                            f"ep({lay.ep}), dp_attention({lay.dp_attention}) and num_nodes_per_replica({npr}) must all be 1")
        if lay.tp % lay.ep:
            raise PlanError(f"{key}.ep({lay.ep}) must divide {key}.tp({lay.tp})")
        try:
            experts_per_rank(cfg.model.num_experts, lay.ep, f"{key}.ep")
        except ValueError as e:
            raise PlanError(str(e)) from None
        if lay.tp % lay.dp_attention:
            raise PlanError(f"{key}.dp_attention({lay.dp_attention}) must divide {key}.tp({lay.tp})")
        if check_fit:
            _check_cpus(cfg, role, "inference.num_cpus_per_task", rpn, i.num_cpus_per_task)
        shape = (f"{npr} nodes" if npr > 1 else f"{rpn} per node") + (
            f", tp{lay.tp} ep{lay.ep} dp-attn{lay.dp_attention}" if backend.uses_gpus else "")
        out.append(RolePlan(role=role, num_procs=num * npr, module="workers.inference", num_nodes=num // rpn * npr,
                            num_tasks_per_node=rpn, num_cpus_per_task=i.num_cpus_per_task, num_gpus_per_node=gpn,
                            mem_gb=i.mem_gb, num_nodes_per_replica=npr, server=lay, config_key=key,
                            description=f"{role}: {num} {i.backend} server(s), {shape}"))
    return out


def plan_control(cfg: RunConfig, backend, *, check_fit: bool) -> list[RolePlan]:
    """Orchestrator, plus the router of a backend that needs one (SGLang: smg; the embedded engine: none)."""
    lo, lr = cfg.launcher.orchestrator, cfg.launcher.router
    roles = [RolePlan(role="orchestrator", num_procs=1, module="workers.orchestrator",
                      num_cpus_per_task=lo.num_cpus_per_task, mem_gb=lo.mem_gb, main=True,
                      config_key="launcher.orchestrator", description="orchestrator: 1 process")]
    if backend.needs_router:
        roles.append(RolePlan(role="router", num_procs=1, module="workers.router", num_cpus_per_task=lr.num_cpus_per_task,
                              mem_gb=lr.mem_gb, config_key="launcher.router",
                              description=backend.router_description or f"router: {backend.name} router"))
    if check_fit:
        _check_cpus(cfg, "control component", "max num_cpus_per_task of orchestrator/router", len(roles),
                    max(r.num_cpus_per_task for r in roles))
    return roles


def assign_groups(cfg: RunConfig, trainer: RolePlan, servers: list[RolePlan], control: list[RolePlan]
                  ) -> tuple[tuple[RolePlan, ...], tuple[ComponentPlan, ...]]:
    """Het groups: control 0, servers 1.., trainer last. Returns roles in start order + components.

    ``launcher.control_placement=trainer``: no control group; the orchestrator and router run as
    extra steps on the trainer group's first node (``--overlap``), sized by the trainer alone, so
    a job uses exactly its GPU nodes."""
    c = cfg.cluster
    on_trainer = cfg.launcher.control_placement == "trainer"
    if on_trainer:
        groups = [*[(s.role, [s]) for s in servers], ("trainer", [trainer])]
    else:
        groups = [("control", control), *[(s.role, [s]) for s in servers], ("trainer", [trainer])]
    placed: dict[str, RolePlan] = {}
    comps = []
    for k, (name, members) in enumerate(groups):
        members = [dataclasses.replace(r, het_group=k) for r in members]
        placed.update({r.role: r for r in members})
        gpus = max(r.num_gpus_per_node for r in members)
        comps.append(ComponentPlan(index=k, name=name, roles=tuple(r.role for r in members),
                                   num_nodes=max(r.num_nodes for r in members),
                                   num_tasks_per_node=sum(r.num_tasks_per_node for r in members),
                                   num_cpus_per_task=max(r.num_cpus_per_task for r in members),
                                   num_gpus_per_node=gpus, mem_gb=sum(r.mem_gb for r in members),
                                   partition=c.partition if gpus else (c.cpu_partition or c.partition),
                                   sbatch_flags=tuple(sorted(getattr(c.groups, name).sbatch_flags.items()))))
    if on_trainer:
        k = len(groups) - 1
        placed.update({r.role: dataclasses.replace(r, het_group=k, overlap=True) for r in control})
        comps[-1] = dataclasses.replace(comps[-1], roles=(*comps[-1].roles, *(r.role for r in control)))
    start = ("trainer", *(s.role for s in servers), *(r.role for r in control))
    return tuple(placed[n] for n in start), tuple(comps)
