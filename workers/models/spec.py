"""ModelSpec: what a model family registers in workers.common.registry.MODELS (key ``model.family``).

A family's home is ``workers/models/<family>/``; its ``spec.py`` registers one ModelSpec when
imported. The launcher uses only the torch-free parts (``config``, ``check``, ``arch``); the
trainer and the embedded engine build through ``build`` / ``init`` and shard through
``parallelize``, each importing the family's torch code lazily. Nothing else names a family.

The interface (every callable takes the family's own config dataclass, ``model_cfg``):

- ``config``: the schema of the ``model`` section (subclass of workers.common.config.ModelConfig).
- ``check(run_cfg)``: plan-time, pure; raises ValueError naming the key (the plan adds the
  checks shared by every family first: :func:`workers.models.checks.check_base`).
- ``arch(model_cfg) -> Architecture``: plan facts (params, active params, MTP, KV bytes per
  token) through workers/models/facts.py. Every family has one, buildable or not.
- ``build(model_cfg, *, device=None, dtype=None) -> nn.Module``: the model with uninitialised
  weights (``device="meta"`` works: no allocation); None for families that only plan.
- ``init(model_cfg, dtype) -> nn.Module``: the step-0 weights (seeded init from
  ``model_cfg.init_seed``, or a converted pretrained checkpoint), on CPU.
- ``to_hf(state) / from_hf(state)``: this family's parameter names <-> Hugging Face names
  (published weights and checkpoints use HF names). Identity where the modules use HF names.
- ``parallelize``: the name of the trainer's TP/EP sharding plan used when tp or ep > 1, from
  the trainer's own table (workers/trainer/parallel/plans.py): by default ``"mesh"``, the plan of any
  CausalLM built from the shared blocks (FSDP2 + DTensor TP + EP on one DeviceMesh); runs with
  tp = ep = 1 use ``"fsdp"``. :meth:`ModelSpec.trainer_plan` decides; the trainer loads it.
- ``hf_architectures`` / ``to_hf_config`` / ``from_hf_config``: the family's config.json (HF names
  and values <-> this family's ``model.*`` fields), for checkpoints in (``model.path``) and out.
- ``router_hook``: the forward keyword through which Router Replay forces experts (int64
  ``[B, T, num_layers, top_k]``, with ``forced_mask [B, T]``); None: no router (dense), so
  ``trainer.router_replay`` and routed-expert records do not apply.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from workers.common.config.ranges import check_fields
from workers.common.registry import PluginSpec
from workers.models.facts import DSA_CHUNK_PAIRS, Architecture, ParamCount, architecture  # noqa: F401  (the launcher's entry)


FSDP_PLAN = "fsdp"
"""Name (in the trainer's plan table, workers/trainer/parallel/plans.py) of the generic plan of any
``CausalLM`` (FSDP2 over data parallel): what tp = ep = 1 runs use."""

MESH_PLAN = "mesh"
"""Name of FSDP2 + DTensor tensor parallel + expert parallel on one DeviceMesh, for any ``CausalLM``
of the shared blocks: what tp or ep > 1 runs use unless a family names another plan."""


def identity(state: dict) -> dict:
    return state


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec(PluginSpec):
    arch: Callable[[Any], Architecture]
    """Plan facts of a config of this family (see workers/models/facts.py)."""
    build: Optional[Callable[..., Any]] = None
    """``build(model_cfg, *, device=None, dtype=None)``: the torch module, weights uninitialised."""
    init: Optional[Callable[[Any, Any], Any]] = None
    """``init(model_cfg, dtype)``: the step-0 model (seeded or pretrained weights), on CPU."""
    to_hf: Callable[[dict], dict] = identity
    """State dict in this family's names -> Hugging Face names."""
    from_hf: Callable[[dict], dict] = identity
    """State dict in Hugging Face names -> this family's names."""
    not_built: Optional[Callable[[Any, str], bool]] = None
    """``(model_cfg, checkpoint name) -> True`` for checkpoint tensors the family does not build
    (DeepSeek-style multi-token-prediction layers ``model.layers.{num_layers}...``, whose names
    depend on the config): skipped by the loader and the launcher's tensor check alike."""
    parallelize: str = MESH_PLAN
    """Name of the tensor/expert-parallel plan in the trainer's table (workers/trainer/parallel/plans.py), used
    when trainer.parallel.tp or ep > 1; empty: the family trains only with tp = ep = 1, under the
    generic FSDP plan (:meth:`trainer_plan`)."""
    no_expert_parallel: str = ""
    """Why this family's experts cannot be split over trainer.parallel.ep > 1 (its tensor-parallel plan
    still applies); empty: they can. :meth:`trainer_plan` refuses ep > 1 with it."""
    router_hook: Optional[str] = None
    """Forward keyword that replays routing (``forced_experts``); None: the family has no router."""
    hf_architectures: tuple[str, ...] = ()
    """config.json ``architectures`` names this family loads (``model.path``: the family is found by them)."""
    to_hf_config: Optional[Callable[[Any], dict]] = None
    """``model_cfg -> config.json dict`` (``architectures``, ``model_type`` and every field under its HF
    name): what a published step's config.json holds, so transformers and SGLang load the step. Torch-free."""
    from_hf_config: Optional[Callable[[dict], dict]] = None
    """``config.json dict -> {model field: value}`` for ``model.path``; raises ValueError naming any
    config.json key whose value the family does not implement. Torch-free (the launcher calls it)."""
    catch_all: Optional[Callable[[dict], tuple[bool, str]]] = None
    """``config.json dict -> (takes it, why not)``: a family that takes checkpoints whose ``architectures``
    no family's ``hf_architectures`` names (the generic transformers path: when transformers builds it)."""
    route_line: Optional[Callable[[Any], str]] = None
    """``model_cfg -> str``: the plan's line on which code path trains and serves the model and why;
    None: ``native family <name>`` (the generic transformers path says what it lacks)."""

    def route(self, model_cfg) -> str:
        """What the plan prints after ``model:`` for the path a run's model takes (torch-free)."""
        return self.route_line(model_cfg) if self.route_line is not None else f"native family {self.name}"

    def trainer_plan(self, tp: int, ep: int) -> str:
        """The sharding plan a run with these degrees uses (plan time and every trainer rank agree):
        tp = ep = 1: the generic FSDP2 plan (:data:`FSDP_PLAN`), for every family; otherwise the
        family's ``parallelize`` (by default :data:`MESH_PLAN`); a family that sets it empty is refused."""
        if tp == 1 and ep == 1:
            return FSDP_PLAN
        if not self.parallelize:
            raise ValueError(f"trainer.parallel.tp({tp}) x ep({ep}): model family {self.name!r} has no tensor/expert-"
                             f"parallel plan (ModelSpec.parallelize is empty); use tp=1 and ep=1 (FSDP over all "
                             f"trainer.num_ranks data-parallel ranks)")
        if ep > 1 and self.no_expert_parallel:
            raise ValueError(f"trainer.parallel.ep({ep}) > 1: model family {self.name!r} has no expert-parallel "
                             f"plan: {self.no_expert_parallel}; use ep=1 (tensor and data parallelism still shard it)")
        return self.parallelize

    def checkpoint_from_hf(self, model_cfg) -> Callable[[dict], dict]:
        """``from_hf`` for loading ``model_cfg.path``: tensors :attr:`not_built` are dropped first."""
        if self.not_built is None:
            return self.from_hf
        skip = self.not_built
        return lambda state: self.from_hf({k: v for k, v in state.items() if not skip(model_cfg, k)})

    @property
    def buildable(self) -> bool:
        """False for families that only plan (facts and checks, no torch code yet)."""
        return self.build is not None

    def plan_check(self, run_cfg) -> None:
        """Plan time (pure): every field in its range, what every family shares (workers/models/checks.py), then the family's own
        ``check``; a family that only plans is refused unless launcher.dry_run=true. ValueError names the key."""
        from workers.models.checks import check_base

        check_fields(run_cfg.model, "model")  # ranges of every field (rules beside the family's schema)
        check_base(run_cfg, self)
        if self.check is not None:
            self.check(run_cfg)

    def params(self, model_cfg) -> ParamCount:
        return self.arch(model_cfg).params()

    def kv_bytes_per_token(self, model_cfg, dtype_bytes: float) -> int:
        return self.arch(model_cfg).kv_bytes_per_token(dtype_bytes)
