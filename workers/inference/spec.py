"""The one interface every inference backend implements (``inference.backend``; registry BACKENDS).

A backend is one package, ``workers/inference/<name>/``, whose ``spec`` module registers a
:class:`BackendSpec` in ``workers.common.registry.BACKENDS`` when imported. The spec owns:

- its config schema (``config``: a subclass of workers/common/config/inference.py InferenceConfig,
  stored as the Hydra option ``inference/<name>`` / ``schema/inference/<name>``);
- its plan: pure, torch-free facts and checks the launcher reads (``check``, ``uses_gpus``,
  ``supports_disaggregation``, ``needs_router``, ``plan_steps``);
- its processes: what a server task runs (``serve``, called by ``python -m workers.inference``)
  and what the router task runs (``serve_router``, called by ``python -m workers.router``);
- what the orchestrator must know beyond the wire protocol (``reports_routing_shape``,
  ``make_router``).

Why so little for the orchestrator: every backend speaks SGLang's native HTTP API (docs/design.md,
"Protocols"), so readiness (``/health_generate``), admin calls (pause, weight updates, continue)
and generation go through one client, workers/common/inference_client.py, for all of them.

Everything here and in each backend's ``spec`` and ``config`` modules is torch-free (the
launcher imports them on the login node); role code is imported inside ``serve`` & co.
A third backend (vLLM, say) is one new folder with a ``spec.py`` + one entry in registry.py's
builtin index (or a plugin module, workers/common/plugins.py), plus a YAML if it wants presets.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

from workers.common.config.ranges import check_fields
from workers.common.registry import BACKENDS, PluginSpec

if TYPE_CHECKING:
    from workers.common.inference_client import InferenceClient


class BackendConfigError(ValueError):
    """A backend refuses the config at plan time; the message names the key (the launcher shows it
    as a PlanError)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackendStep:
    """What the sbatch script shows and exports for one server role or the router of a backend."""

    role: str
    """inference | prefill | decode | router."""
    argv: tuple[str, ...]
    """Replica 0's head command, with placeholders (``<node>``, ``<http_port>``) for what Slurm decides."""
    env: tuple[tuple[str, str], ...]
    """Exported to this step's tasks only (e.g. NVSHMEM for DeepEP)."""
    features: tuple[str, ...]
    """Short names of the features this role turns on (plan summary, the Slurm guide's table)."""


class RoutedGeneration(Protocol):
    """What ``make_router`` returns: generation through the backend's router (e.g. smg)."""

    health: "InferenceClient"
    """A client whose /health_generate checks the router itself (after the servers are up)."""

    def for_group(self, group_id: int) -> "InferenceClient":
        """A client for every request of one prompt group (sticky routing: one group, one server)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackendSpec(PluginSpec):
    """An inference backend. ``name`` is the value of ``inference.backend``; ``config`` its schema;
    ``check(run_cfg)`` its plan-time rules (pure; raise :class:`BackendConfigError` naming the key)."""

    serve: Callable[[Any, Any], int]
    """``serve(run_cfg, topology) -> exit code``: run this server task (one per node of a replica) until
    SIGTERM; may exec another program instead (it never returns then). Reads the admin token itself."""
    uses_gpus: bool = False
    """True: servers get their nodes' GPUs (cluster.num_gpus_per_node), a replica's tp equals its GPUs,
    and cluster=local is refused. False: one CPU process per server (tp, ep, dp_attention and
    num_nodes_per_replica must be 1)."""
    supports_disaggregation: bool = False
    """Prefill/decode disaggregation (inference.num_prefill_replicas / num_decode_replicas) is allowed."""
    needs_router: bool = False
    """A router task runs in the control component and generation goes through it (``serve_router``,
    ``make_router``); False: the orchestrator balances over the servers itself."""
    router_description: str = ""
    """The router role's line in the plan summary (``router: ...``)."""
    serve_router: Optional[Callable[[Any, Any], int]] = None
    """``serve_router(run_cfg, topology) -> exit code``: the router task (``python -m workers.router``)."""
    plan_steps: Optional[Callable[[Any], tuple[BackendStep, ...]]] = None
    """``plan_steps(run_cfg)``: command previews of each server role (then the router), in het-group
    order, for the sbatch script and the plan summary; pure. None: nothing to show."""
    reports_routing_shape: bool = True
    """/get_model_info reports num_layers, top_k and num_experts (the client then reads them there);
    False: the orchestrator passes them from cfg.model (SGLang's model info lacks them)."""
    make_router: Optional[Callable[..., RoutedGeneration]] = None
    """``make_router(run_cfg, url, admin_token, *, session, timeout_s, shape, topology)``: the orchestrator's
    generation client for the router at ``url`` (``shape``: (num_layers, top_k, num_experts) or Nones;
    ``topology``: the job's server URLs, for a backend that pairs servers itself)."""
    serves_api_of: tuple[str, ...] = ()
    """Other backends whose server this one runs unchanged (a wrapper around the embedded server says
    ``("embedded",)``): weight transports that talk to those talk to this one too."""


    def plan_check(self, run_cfg: Any) -> None:
        """Plan time (pure): every field of the inference section in its range or choices (the rules
        beside this backend's schema, workers/common/config/ranges.py), then ``check``."""
        check_fields(run_cfg.inference, "inference")
        if self.check is not None:
            self.check(run_cfg)


def backend_of(run_cfg: Any) -> BackendSpec:
    """The spec that ``run_cfg.inference.backend`` names (UnknownEntry, naming the key, if none)."""
    return BACKENDS.get(run_cfg.inference.backend)


def register(spec: BackendSpec) -> BackendSpec:
    """Register a backend (builtin ``spec`` modules and plugins alike)."""
    return BACKENDS.register(spec)
