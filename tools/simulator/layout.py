"""JobPlan -> the replicas and trainer the simulator runs, and candidate node splits.

Why through the launcher's own planner: a split the simulator recommends must be one the
launcher accepts. Every candidate is a RunConfig variant (replica counts and sizes,
trainer nodes and dims) passed to ``launcher.plan.build_plan``; whatever the plan refuses
(a trainer whose states do not fit, tp that does not match the nodes, ...) is skipped and
counted. On top of the plan's memory estimate, the simulator checks the weights SGLang
really holds per GPU with DP attention (attention, dense and embedding weights replicated
over the DP-attention ranks); a replica over budget gets the largest ``dp_attention``
that fits, and the report says so.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator, Optional

from tools.simulator.costs import GPUS_PER_NODE, ClusterCosts, Replica
from launcher.plan import JobPlan, PlanError, build_plan
from workers.common.config import RunConfig
from workers.common.topology import PORT_SERVERS

KIND = {"prefill": "prefill", "decode": "decode", "inference": "unified"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    replicas: tuple[Replica, ...]
    trainer_gpus: int
    trainer_nodes: int
    gpu_nodes: int
    notes: tuple[str, ...] = ()

    def of(self, kind: str) -> tuple[Replica, ...]:
        return tuple(r for r in self.replicas if r.kind == kind)

    @property
    def label(self) -> str:
        """Replicas x nodes per role: ``P2x2 D2x4 T16``; embedded CPU workers: ``I2 T1``."""
        parts = []
        for kind in ("prefill", "decode", "unified"):
            rs = self.of(kind)
            if rs:
                parts.append(f"{kind[0].upper()}{len(rs)}x{rs[0].num_nodes}" if rs[0].num_gpus else f"I{len(rs)}")
        return " ".join(parts) + f" T{self.trainer_nodes}"

    def detail(self) -> str:
        def one(kind: str) -> str:
            rs = self.of(kind)
            if not rs:
                return ""
            r = rs[0]
            return (f"{kind} {len(rs)}x{r.num_nodes}n tp{r.tp} ep{r.ep} dp{r.dp_attention}"
                    if r.num_gpus else f"{kind} {len(rs)} CPU worker(s)")
        roles = [one(k) for k in ("prefill", "decode", "unified")]
        return "; ".join(x for x in roles if x) + f"; trainer {self.trainer_gpus} GPU(s) on {self.trainer_nodes} node(s)"


def layout_from_plan(plan: JobPlan) -> Layout:
    reps = []
    for role in plan.roles:
        if role.server is None:
            continue
        lay = role.server
        sg = getattr(lay, "sglang", None)  # SGLang server arguments, when the config has them
        opt = lambda name: (getattr(sg, name, None) or 0) if sg is not None else 0  # noqa: E731
        hicache = bool(opt("enable_hierarchical_cache"))
        for i in range(role.num_replicas):
            reps.append(Replica(kind=KIND[role.role], index=i, num_gpus=lay.tp if role.num_gpus_per_node else 0,
                                num_nodes=lay.num_nodes_per_replica, tp=lay.tp, ep=lay.ep, dp_attention=lay.dp_attention,
                                hicache_ratio=opt("hicache_ratio") if hicache else 0.0,
                                hicache_gb_per_gpu=opt("hicache_size_gb") if hicache else 0.0,
                                max_batch_per_gpu=opt("cuda_graph_max_bs"), max_running=opt("max_running_requests"),
                                redundant_experts=opt("ep_num_redundant_experts") if opt("enable_eplb") else 0))
    t = plan.role("trainer")
    return Layout(replicas=tuple(reps), trainer_gpus=t.num_procs if t.num_gpus_per_node else 0,
                  trainer_nodes=t.num_nodes, gpu_nodes=plan.num_gpu_nodes)


def fit_memory(layout: Layout, costs: ClusterCosts, gpu_gb: float) -> Layout:
    """Lower dp_attention until each replica's weights leave KV room; note every change."""
    usable = gpu_gb * 1e9 * costs.a.serving.mem_fraction
    notes, out = list(layout.notes), []
    changed: dict[str, str] = {}
    for r in layout.replicas:
        fixed = r
        while costs.weights_per_gpu(fixed) > 0.85 * usable and fixed.dp_attention > 1:
            fixed = dataclasses.replace(fixed, dp_attention=fixed.dp_attention // 2)
        if fixed is not r:
            changed[r.kind] = (f"{r.kind}: tp{r.tp} dp-attn{r.dp_attention} holds "
                               f"{costs.weights_per_gpu(r) / 1e9:.0f} GB of weights per GPU (attention replicated per "
                               f"DP rank) > 85% of {usable / 1e9:.0f} GB usable; simulated with dp-attn{fixed.dp_attention} "
                               f"({costs.weights_per_gpu(fixed) / 1e9:.0f} GB)")
        out.append(fixed)
    return dataclasses.replace(layout, replicas=tuple(out), notes=tuple(notes + list(changed.values())))


def with_split(cfg: RunConfig, *, prefill: tuple[int, int], decode: tuple[int, int], trainer_nodes: int,
               keep: Optional[RunConfig] = None) -> RunConfig:
    """A config with ``prefill=(replicas, nodes each)``, ``decode=(...)`` and trainer nodes (EP kept)."""
    gpn = cfg.cluster.num_gpus_per_node or GPUS_PER_NODE
    inf, lt, par = cfg.inference, cfg.launcher.trainer, cfg.trainer.parallel

    def server(layout, nodes: int):
        tp = nodes * gpn
        return dataclasses.replace(layout, num_nodes_per_replica=nodes, num_replicas_per_node=1, tp=tp,
                                   ep=min(tp, cfg.model.num_experts), dp_attention=tp)

    ranks = trainer_nodes * gpn
    shard = par.tp * par.pp * par.ep * par.cp
    inference = dataclasses.replace(inf, num_prefill_replicas=prefill[0], prefill=server(inf.prefill, prefill[1]),
                                    num_decode_replicas=decode[0], decode=server(inf.decode, decode[1]))
    trainer = dataclasses.replace(cfg.trainer, num_ranks=ranks, parallel=dataclasses.replace(
        par, dp=ranks // shard if ranks % shard == 0 else -1))
    cluster = cfg.cluster
    need = 2 * PORT_SERVERS + 8 * (prefill[0] + decode[0])  # generous: the plan counts ~2-5 ports per server
    if need > cluster.port_span:  # a big job needs a wider port block per job (fewer concurrent jobs fit)
        span = -(-need // 16) * 16
        cluster = dataclasses.replace(cluster, port_span=span,
                                      num_port_slots=min(cluster.num_port_slots, (65536 - cluster.port_min) // span))
    launcher = dataclasses.replace(cfg.launcher, num_gpu_nodes=prefill[0] * prefill[1] + decode[0] * decode[1] + trainer_nodes,
                                   trainer=dataclasses.replace(lt, num_nodes=trainer_nodes))
    return dataclasses.replace(cfg, inference=inference, trainer=trainer, launcher=launcher, cluster=cluster)


def candidate_splits(cfg: RunConfig, total_nodes: int, *, replica_nodes: tuple[int, ...] = (2, 4),
                     max_candidates: int = 400) -> Iterator[tuple[RunConfig, JobPlan]]:
    """Every (prefill, decode, trainer) split of ``total_nodes`` GPU nodes that build_plan accepts."""
    par = cfg.trainer.parallel
    step = max(1, par.tp * par.pp * par.ep * par.cp // (cfg.cluster.num_gpus_per_node or GPUS_PER_NODE))
    seen = 0
    for t_nodes in range(step, total_nodes, step):
        rest = total_nodes - t_nodes
        for p_size in replica_nodes:
            for d_size in replica_nodes:
                for p_num in range(1, rest // p_size + 1):
                    left = rest - p_num * p_size
                    if left <= 0 or left % d_size:
                        continue
                    variant = with_split(cfg, prefill=(p_num, p_size), decode=(left // d_size, d_size), trainer_nodes=t_nodes)
                    try:
                        plan = build_plan(variant)
                    except PlanError:
                        continue
                    seen += 1
                    if seen > max_candidates:
                        return
                    yield variant, plan
