"""build_plan(cfg) -> JobPlan: which processes run, where, how many, and every cross-role check.

Pure function of the config (no I/O, no torch): the same plan drives the local backend,
the sbatch renderer and the dry run. A user mistake raises :class:`PlanError` naming the
config key and the numbers involved, before anything is started or written.

Slurm placement: one heterogeneous-job component per role group, in this order:
  0  control: orchestrator (+ the router of a backend that needs one, e.g. smg for SGLang), CPU only
  1+ servers: ``inference`` (unified workers) or ``prefill`` then ``decode``
  N  trainer ranks (one per GPU on GPU clusters)
With the embedded engine there is no router: the orchestrator spreads requests over the
workers itself, so the component is simply absent (not a no-op step). The inference backend
is reached only through its registry spec (workers/inference/spec.py): its checks, placement
facts and command previews.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import re
from typing import TYPE_CHECKING, Iterator, Optional

from launcher.activations import FIT_FRACTION, longest_sample, trainer_fit
from launcher.estimate import (MemoryEstimate, ParamCount, count_params, human, server_memory, states_formula,
                               trainer_memory)
from launcher import lora_plan
from launcher.gpus import LocalGPUs, ProcessGPUs, check_preset, place_local, placement_lines
from launcher.resources import (ComponentPlan, RolePlan, SlurmJobPlan, TrainerDims, assign_groups, plan_control,
                                plan_servers, plan_trainer)
from launcher.resources import PlanError  # noqa: F401  (re-exported: callers import it from here)
from workers.models.weight_integrity import norms_at_init
from workers.common.config import RunConfig, conform_sections
from workers.common.config.algorithm import check_algorithm, describe as describe_algorithm
from workers.common.config.ranges import check_fields
from workers.common.dtypes import held_dtype
from workers.common.fp8_plan import check_float8
from workers.common.registry import BACKENDS, ENVS, MODELS, SECTIONS, TRANSPORTS
from workers.common.topology import PORT_SERVERS
from workers.preflight.limits import limit_errors
from workers.weights.spec import check_transport as _transport_check

if TYPE_CHECKING:
    from workers.inference.spec import BackendStep


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobPlan:
    experiment: str
    backend: str
    roles: tuple[RolePlan, ...]
    """In start order (trainer first: rank 0 publishes the step-0 weights)."""
    components: tuple[ComponentPlan, ...]
    """Slurm het-job components, by het group."""
    num_params: int
    """Model parameters (printed by the launcher)."""
    params: ParamCount
    samples_per_step: int
    trainer_dims: TrainerDims
    slurm: SlurmJobPlan
    memory: tuple[MemoryEstimate, ...] = ()
    """GPU memory estimates (GPU clusters with cluster.gpu_memory_gb set)."""
    preflight: bool = False
    """Run workers.preflight as the Slurm job's first step (top-level ``preflight=true``)."""
    inference_backend: str = "embedded"
    """``inference.backend`` (its spec: workers.common.registry.BACKENDS)."""
    backend_steps: tuple[BackendStep, ...] = ()
    """Each server role's and the router's command preview and step env (backends with ``plan_steps``)."""
    model: str = ""
    """``<model.name> (family <model.family>[, from <model.path>])``: what the summary names."""
    route: str = ""
    """Which code trains and serves the model, and why (``ModelSpec.route``: ``native family qwen3_moe``,
    or the generic transformers path and what it lacks)."""
    weight_update: str = ""
    """The weight transport's cost per update, where it is known (:func:`weight_update_line`)."""
    lora: str = ""
    """``trainer.lora``'s line (launcher/lora_plan.py summary_line): trainable params, memory, bytes per update."""
    algorithm: str = ""
    """The RL recipe and its effective settings, one line (workers/common/config/algorithm.py ``describe``)."""
    local_gpus: Optional[LocalGPUs] = None
    """Local backend: the GPUs of this machine the run may use (launcher/gpus.py detect_gpus)."""
    gpu_placement: tuple[ProcessGPUs, ...] = ()
    """Local backend: each process's CUDA_VISIBLE_DEVICES (trainer ranks, then servers; "" = none);
    () without GPUs (nothing is set: every role on the CPU)."""

    def role(self, name: str) -> RolePlan:
        return next(r for r in self.roles if r.role == name)

    @property
    def num_gpu_nodes(self) -> int:
        return sum(c.num_nodes for c in self.components if c.num_gpus_per_node)

    @property
    def num_nodes(self) -> int:
        return sum(c.num_nodes for c in self.components)

    def summary(self) -> list[str]:
        """Human-readable lines the launcher prints (and the dry run shows)."""
        p = self.params
        lines = [f"model: {self.model + ': ' if self.model else ''}{human(p.total)} params ({human(p.active)} active per token"
                 + (f", +{human(p.mtp)} in MTP layers: counted; skipped on load, not trained, "
                                      "not in published steps" if p.mtp else "") + ")"]
        lines += [f"model path: {self.route}"] if self.route else []
        for c in self.components:
            gpus = f", {c.num_gpus_per_node} GPUs/node" if c.num_gpus_per_node else ""
            where = f"het group {c.index} {c.name}: {c.num_nodes} node(s){gpus}" if self.backend != "local" else c.name
            lines.append(f"{where}; " + "; ".join(self.role(r).description for r in c.roles))
        split = " + ".join(f"{c.name} {c.num_nodes}" for c in self.components if c.num_gpus_per_node)
        if self.backend == "local":
            lines += [one_machine_line(self.gpu_placement)] if self.gpu_placement else []
        elif split:
            lines.append(f"GPU nodes: {split} = {self.num_gpu_nodes}; all nodes: {self.num_nodes}")
        lines.append(f"trainer dims: {self.trainer_dims.describe()}")
        lines += [f"algorithm {self.algorithm}"] if self.algorithm else []
        lines += [self.lora] if self.lora else []
        lines += [f"WARNING {w}" for w in self.trainer_dims.warnings]
        if self.backend == "slurm" and self.roles and not any(r.role == "router" for r in self.roles):
            lines.append(f"router: none ({self.inference_backend} inference: the orchestrator balances over the "
                         f"workers itself)")
        lines += [f"memory {m.what}: {m.detail}" for m in self.memory]
        lines += [f"weights: {self.weight_update}"] if self.weight_update else []
        lines += [f"{self.inference_backend} {s.role}: {', '.join(s.features)}" for s in self.backend_steps]
        if self.local_gpus is not None:
            lines += placement_lines(self.gpu_placement, self.local_gpus)
        return lines


def one_machine_line(placement: tuple[ProcessGPUs, ...]) -> str:
    """A local plan's size: every process on this one machine, the GPUs each role holds (the components'
    node counts are Slurm's het groups, meaningless here: 8 GPUs are not "6 nodes")."""
    roles: dict[str, set[str]] = {}
    for p in placement:
        if p.cuda_visible_devices:
            roles.setdefault(p.role, set()).update(p.cuda_visible_devices.split(","))
    total = set().union(*roles.values()) if roles else set()
    split = " + ".join(f"{role} {len(ids)}" for role, ids in roles.items())
    return (f"GPUs in use: {split} = {len(total)} GPU(s) on ONE machine (local backend: every process here, "
            f"no Slurm job)" + (" (shared: roles hold the same GPUs)" if sum(map(len, roles.values())) > len(total)
                                  else ""))


@contextlib.contextmanager
def plan_errors() -> Iterator[None]:
    """Entries' checks raise ValueError (workers/ never imports the launcher's PlanError; ConfigError
    and UnknownEntry are ValueErrors too): report each as a PlanError, the message unchanged."""
    try:
        yield
    except PlanError:
        raise
    except ValueError as e:
        raise PlanError(str(e)) from None


def check_ranges(cfg: RunConfig) -> None:
    """Every field of the run's own sections in its range or choices (the rules beside each schema,
    workers/common/config/ranges.py); the four plugin sections are checked by their entries' checks,
    and the inference section here too: placement (launcher/resources.py) reads its sizes before the
    backend's own check runs."""
    with plan_errors():
        check_fields(cfg, "", skip=SECTIONS)
        check_fields(cfg.inference, "inference")
    for mod in cfg.plugins:  # every role imports them first: a missing one would stop each of them
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise PlanError(f"plugins: module {mod!r} cannot be found (every role imports it before loading its config)")


def check_tracking(cfg: RunConfig) -> None:
    """A tracker that is asked for is installed where the launcher runs (the trainer imports it too)."""
    if cfg.tracking.wandb and importlib.util.find_spec("wandb") is None:
        raise PlanError("tracking.wandb=true needs the wandb package, not installed here: pip install wandb "
                        "(or pip install -e '.[tracking]'); it logs offline by default (tracking.wandb_mode)")


def check_model(cfg: RunConfig) -> None:
    """The checks every family shares (workers/models/checks.py), then the family's own (its spec);
    a family that only plans is refused unless launcher.dry_run=true."""
    with plan_errors():
        MODELS.get(cfg.model.family).plan_check(cfg)


def check_env(cfg: RunConfig) -> None:
    """The env's own checks (latency, vocabulary or tokenizer, its fields) through its spec
    (workers/orchestrator/envs/spec.py)."""
    with plan_errors():
        spec = ENVS.get(cfg.env.name)
        spec.check(cfg)
    if cfg.orchestrator.eval_every_steps > 0 and not spec.eval_split:
        raise PlanError(f"orchestrator.eval_every_steps({cfg.orchestrator.eval_every_steps}) > 0 but env={spec.name} has "
                        f"no eval split: give its env class eval_tasks(n) and register it with eval_split=True "
                        f"(every built-in env has one)")


def check_loop(cfg: RunConfig) -> int:
    """The rules that span fields of the loop (each field's own range: :func:`check_ranges`)."""
    o, t = cfg.orchestrator, cfg.trainer
    samples = o.num_prompts_per_step * o.num_samples_per_prompt
    if o.max_inflight_rollouts < o.num_samples_per_prompt:
        raise PlanError(f"orchestrator.max_inflight_rollouts({o.max_inflight_rollouts}) must hold at least one prompt "
                        f"group (orchestrator.num_samples_per_prompt={o.num_samples_per_prompt})")
    if t.num_ranks > samples:
        raise PlanError(f"trainer.num_ranks({t.num_ranks}) > samples per step ({samples} = orchestrator."
                        f"num_prompts_per_step({o.num_prompts_per_step}) * num_samples_per_prompt({o.num_samples_per_prompt}))")
    if not 0 < t.ratio_mask_low <= 1 <= t.ratio_cap <= t.ratio_mask_high:
        raise PlanError(f"need 0 < trainer.ratio_mask_low({t.ratio_mask_low}) <= 1 <= trainer.ratio_cap({t.ratio_cap}) "
                        f"<= trainer.ratio_mask_high({t.ratio_mask_high})")
    return samples


def check_transport(cfg: RunConfig) -> None:
    """The weight transport's plan check (workers/weights/spec.py), reported as a PlanError."""
    with plan_errors():
        _transport_check(cfg)


def check_group_flags(cfg: RunConfig, components) -> None:
    """Flags for a het group this plan does not have would be dropped silently: refuse them."""
    names = [c.name for c in components]
    for group in ("control", "inference", "prefill", "decode", "trainer"):
        if getattr(cfg.cluster.groups, group).sbatch_flags and group not in names:
            raise PlanError(f"cluster.groups.{group}.sbatch_flags is set but this plan has no {group} group "
                            f"(its het groups: {', '.join(names)})")


def check_cluster(cfg: RunConfig, num_servers: int) -> None:
    c = cfg.cluster
    if c.container.runtime == "none":
        unused = [k for k in ("image", "mounts", "workdir") if getattr(c.container, k)]
        if unused:  # silently dropped otherwise: the steps would run on the host's Python
            raise PlanError(f"cluster.container.{unused[0]} is set but cluster.container.runtime=none runs every "
                            f"step on the host; set cluster.container.runtime=pyxis or apptainer (or drop "
                            f"cluster.container.{unused[0]})")
    else:
        if c.backend != "slurm":
            raise PlanError(f"cluster.container.runtime={c.container.runtime} runs Slurm steps in a container; "
                            f"cluster.backend={c.backend} starts local processes (set runtime=none)")
        if not c.container.image:
            raise PlanError(f"cluster.container.image is empty; cluster.container.runtime={c.container.runtime} needs "
                            f"an image ({'an enroot image or .sqsh' if c.container.runtime == 'pyxis' else 'a .sif file'})")
    need = PORT_SERVERS + 2 * num_servers
    if c.port_span < need:
        raise PlanError(f"cluster.port_span({c.port_span}) < {need} ports this job needs "
                        f"({PORT_SERVERS} fixed + 2 per server x {num_servers} servers)")
    top = c.port_min + c.num_port_slots * c.port_span
    if c.port_min < 1024 or top > 65536:
        raise PlanError(f"ports [cluster.port_min({c.port_min}), +num_port_slots({c.num_port_slots}) * "
                        f"port_span({c.port_span}) = {top}) must lie in [1024, 65536)")
    if c.respawn_backoff_max_s < c.respawn_backoff_s:
        raise PlanError(f"cluster.respawn_backoff_max_s({c.respawn_backoff_max_s:g}) < "
                        f"cluster.respawn_backoff_s({c.respawn_backoff_s:g}): the cap is below the first wait")
    if "{node}" not in c.node_address and not re.match(r"^[\w.:-]+$", c.node_address):
        raise PlanError(f"cluster.node_address={c.node_address!r} must contain '{{node}}' or be a plain address")


def estimate_memory(cfg: RunConfig, params: ParamCount, roles: tuple[RolePlan, ...], *, rows_per_rank: int = 1
                    ) -> tuple[tuple[MemoryEstimate, ...], tuple[str, ...]]:
    """Trainer states + activations and replica weights per GPU, and warnings; raises when something
    cannot fit (activations of the longest sequence: a warning in a dry run, which plans presets whose
    context-parallel layout is still to come; a real run is refused)."""
    gpu_gb = cfg.cluster.gpu_memory_gb
    if gpu_gb <= 0 or cfg.cluster.num_gpus_per_node <= 0:
        return (), ()
    out, warnings = [], []
    for r in roles:
        if r.role == "trainer":
            lora = cfg.trainer.lora.enabled  # a frozen base + adapters: launcher/lora_plan.py
            est = (lora_plan.trainer_memory(cfg, r.num_procs, gpu_gb) if lora
                   else trainer_memory(params, r.num_procs, gpu_gb, cfg.trainer.master_dtype))
            key = "launcher.trainer.num_nodes"
            if est.fits:
                total, line, need = trainer_fit(cfg, est.per_gpu_gb, gpu_gb, num_ranks=r.num_procs,
                                                rows_per_rank=rows_per_rank,
                                                states_how=lora_plan.states_formula(cfg, r.num_procs) if lora
                                                else states_formula(params, r.num_procs, cfg.trainer.master_dtype))
                if total > FIT_FRACTION * gpu_gb:
                    t = cfg.trainer
                    cures = ([f"trainer.parallel.cp >= {need} (context parallel)"] if need else []) + (
                        [f"trainer.micro_batch_tokens={longest_sample(cfg)[0]} (one longest sample per forward)"]
                        if t.micro_batch_tokens == 0 and rows_per_rank > 1 else []) + (
                        ["trainer.activation_checkpointing=full"] if t.activation_checkpointing != "full" else []) + [
                        "a smaller trainer.logprob_chunk_tokens", "more trainer GPUs"]
                    cure = ", ".join(cures[:-1]) + " or " + cures[-1]
                    if getattr(cfg.model, "num_indexer_heads", 0) and not getattr(cfg.model, "dsa_chunk_tokens", 1):
                        cure += ("; model.dsa_chunk_tokens=0 runs the DSA indexer's dense reference path, which "
                                 + ("scores every (query, key) pair at once" if t.parallel.cp == 1 else
                                    "scores in chunks but keeps the quadratic work") + ": set it > 0 (the memory-linear path)")
                    problem = (f"trainer does not fit its GPUs with the activations of its largest forward: {line}; "
                               f"use {cure}")
                    if not cfg.launcher.dry_run:
                        raise PlanError(problem)
                    warnings.append(f"{problem} (a real run is refused)")
                est = MemoryEstimate(what="trainer", per_gpu_gb=total, gpu_gb=FIT_FRACTION * gpu_gb, detail=line)
                out.append(est)
                continue
        elif r.server is not None and r.num_gpus_per_node:
            est = server_memory(r.role, cfg.model, params, dtype=held_dtype(cfg.inference.dtype), tp=r.server.tp, gpu_gb=gpu_gb)
            key = f"{r.config_key}.tp / num_nodes_per_replica"
        else:
            continue
        if not est.fits:
            raise PlanError(f"{r.role} does not fit its GPUs: {est.detail}; raise {key}")
        out.append(est)
    return tuple(out), tuple(warnings)


def check_preflight(cfg: RunConfig, components: tuple[ComponentPlan, ...]) -> None:
    if not cfg.preflight:
        return
    if cfg.cluster.backend != "slurm":
        raise PlanError("preflight=true runs as the first step of the Slurm job (cluster.backend=slurm); "
                        "to check this machine run `slurmrl-preflight standalone --out DIR`")
    errors = limit_errors(cfg.cluster.preflight, component_names=[c.name for c in components])
    if errors:
        raise PlanError("; ".join(errors))


def check_backend(cfg: RunConfig):
    """The spec of ``inference.backend``: known, given its own schema, and placeable on this cluster."""
    with plan_errors():
        backend = BACKENDS.get(cfg.inference.backend)
    if not isinstance(cfg.inference, backend.config):
        raise PlanError(f"inference.backend={backend.name!r} reads the {backend.config.__name__} schema but the "
                        f"inference section is a {type(cfg.inference).__name__}: choose it with "
                        f"inference={backend.name}")
    return backend


def check_sections(cfg: RunConfig) -> None:
    """Each plugin section fits the schema of the entry it names (a field that entry does not use,
    e.g. an MLA rank on a tiny_moe model, is refused with its name; the launcher conforms the
    sections already, this guards plans built from Python)."""
    with plan_errors():
        conform_sections(cfg)


def weight_update_line(cfg: RunConfig, params: ParamCount) -> str:
    """The weight transport's own line on one update's cost (TransportSpec.update_line; the SGLang
    protocol's bytes per inference GPU and seconds, the simulator's figure too); "" where it has none."""
    if cfg.trainer.lora.enabled:  # the update is the adapter, whatever the transport (launcher/lora_plan.py)
        return lora_plan.update_line(cfg)
    spec = TRANSPORTS.get(cfg.weights.transport)
    return spec.update_line(cfg, params.total) if spec.update_line is not None else ""


def build_plan(cfg: RunConfig, *, gpus: Optional[LocalGPUs] = None) -> JobPlan:
    """``gpus``: the local backend's GPUs (launcher/gpus.py detect_gpus, which the launcher calls);
    None: ``cluster.num_gpus_per_node`` of them (0: none), so the plan stays a function of its inputs."""
    check_sections(cfg)
    check_ranges(cfg)
    check_tracking(cfg)
    check_preset(cfg)  # experiment=one_gpu_node needs model.path
    check_model(cfg)
    check_env(cfg)
    samples = check_loop(cfg)
    with plan_errors():  # the recipe's cross-section rules; warnings for a user's checkpoint
        algorithm_warnings = check_algorithm(cfg, pretrained=not norms_at_init(getattr(cfg.model, "path", "")))
    lora_warnings = lora_plan.check_lora(cfg)  # trainer.lora: layout, targets, the learning-rate hint
    check_transport(cfg)  # weights.transport's own check (workers/weights/<transport>/__init__.py)
    slurm = cfg.cluster.backend == "slurm"
    backend = check_backend(cfg)
    with plan_errors():  # inference.dtype=float8: the embedded engine on a named fp8 GPU
        check_float8(cfg)
    servers = plan_servers(cfg, backend, check_fit=slurm)
    with plan_errors():  # the backend's field ranges and its own option rules (e.g. workers/inference/sglang/checks.py)
        backend.plan_check(cfg)
    trainer, dims = plan_trainer(cfg, check_fit=slurm)
    control = plan_control(cfg, backend, check_fit=slurm)
    if not slurm:
        n = cfg.cluster.num_gpus_per_node
        if gpus is None:
            gpus = LocalGPUs(tuple(str(i) for i in range(n)), f"cluster.num_gpus_per_node={n}")
        placement = place_local(cfg, backend, servers, control, gpus)
    roles, components = assign_groups(cfg, trainer, servers, control)  # trainer starts first: it publishes step 0
    check_cluster(cfg, sum(r.num_replicas for r in servers))
    check_group_flags(cfg, components)
    gpu_nodes = sum(c.num_nodes for c in components if c.num_gpus_per_node)
    if cfg.launcher.num_gpu_nodes and gpu_nodes != cfg.launcher.num_gpu_nodes:
        split = " + ".join(f"{c.name}({c.num_nodes})" for c in components if c.num_gpus_per_node)
        raise PlanError(f"launcher.num_gpu_nodes({cfg.launcher.num_gpu_nodes}) != GPU nodes planned: {split} = {gpu_nodes}")
    check_preflight(cfg, components)
    params = count_params(cfg.model)
    memory, memory_warnings = estimate_memory(cfg, params, roles,
                                              rows_per_rank=-(-samples // (dims.dp * dims.ep)))
    dims = dataclasses.replace(dims, warnings=dims.warnings + memory_warnings + tuple(algorithm_warnings)
                               + tuple(lora_warnings))
    return JobPlan(experiment=cfg.experiment, backend=cfg.cluster.backend, roles=roles, components=components,
                   num_params=params.total, params=params, samples_per_step=samples, trainer_dims=dims,
                   slurm=SlurmJobPlan.from_config(cfg), memory=memory,
                   preflight=cfg.preflight, inference_backend=backend.name,
                   backend_steps=backend.plan_steps(cfg) if backend.plan_steps else (),
                   model=f"{cfg.model.name} (family {cfg.model.family}"
                         + (f", from {cfg.model.path}" if getattr(cfg.model, "path", "") else "") + ")",
                   route=MODELS.get(cfg.model.family).route(cfg.model), weight_update=weight_update_line(cfg, params),
                   local_gpus=None if slurm else gpus, gpu_placement=() if slurm else placement,
                   algorithm=describe_algorithm(cfg), lora=lora_plan.summary_line(cfg) if cfg.trainer.lora.enabled else "")

