"""The whole run's config: one section per role or axis, and how a resolved run.yaml is loaded.

Four sections are chosen by a plugin entry (workers/common/registry.py SECTIONS): ``model`` by
``model.family``, ``weights`` by ``weights.transport``, ``env`` by ``env.name``, ``inference`` by
``inference.backend``. Their fields are typed ``Any`` here and get the entry's own schema when
composed (Hydra group options extend the registered schema) or loaded (:func:`load_run_config`),
so a field the chosen entry does not use is refused with its name, never dropped.
"""
from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError

from workers.common.config.algorithm import AlgorithmConfig
from workers.common.config.cluster import ClusterConfig
from workers.common.config.inference import InferenceConfig
from workers.common.config.launcher import LauncherConfig
from workers.common.config.orchestrator import OrchestratorConfig
from workers.common.config.ranges import NONEMPTY, SEED, ConfigError, Each, Pattern, check_fields, limits
from workers.common.config.tracking import TrackingConfig
from workers.common.config.trainer import TrainerConfig
from workers.common.plugins import load_plugins
from workers.common.registry import SECTIONS


def _default(section: str, name: str):
    return lambda: SECTIONS[section][1].get(name).config()


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    experiment: str = "tiny_local"
    """Name of the experiment bundle."""
    name: str = ""
    """This run's name: its directory ``<cluster.runs_root>/<name>`` (``<name>-2``, ... when taken), the
    Slurm job name ``slurmrl-<name>`` and the W&B run name; "" = ``<experiment>-<date>-<time>``."""
    seed: int = 0
    """Global seed (sampling, data order)."""
    preflight: bool = False
    """Slurm: check every node's GPUs and the collective bandwidth as the job's first step and stop
    the job with a report before any role starts (limits: ``cluster.preflight``)."""
    plugins: list[str] = field(default_factory=list)
    """Modules to import before the config is loaded (they register models, transports, envs or
    backends); the launcher adds ``SLURMRL_PLUGINS`` here so every role imports the same ones."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: Any = MISSING
    """Schema chosen by ``model.family`` (workers/models)."""
    inference: Any = field(default_factory=lambda: InferenceConfig(backend="embedded"))
    """Schema chosen by ``inference.backend`` (workers/inference); the default is the shared base class, so
    Hydra can merge any backend's schema (a subclass of it) onto it."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The RL recipe the run started from (``algorithm=``; its knobs are trainer.* / orchestrator.* keys)."""
    weights: Any = field(default_factory=_default("weights", "filesystem"))
    """Schema chosen by ``weights.transport`` (workers/weights)."""
    env: Any = MISSING
    """Schema chosen by ``env.name`` (workers/orchestrator/envs)."""
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """Experiment trackers beside metrics.jsonl and TensorBoard (``tracking.wandb=true``)."""


MODULE = Pattern(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", "a module name (dotted, importable)")
RUN_NAME = Pattern(r"([A-Za-z0-9][A-Za-z0-9._+-]{0,99})?", "\"\" or a directory name (letters, digits, . _ + -; "
                   "at most 100 characters, not starting with . or -)")
limits(RunConfig, experiment=NONEMPTY, name=RUN_NAME, seed=SEED, plugins=Each(MODULE))


def section_schema(section: str, name: str) -> type:
    return SECTIONS[section][1].get(name).config


def structure_section(section: str, node: Any) -> DictConfig:
    """``node`` (a dict, DictConfig or dataclass) on the schema its entry chooses; a field the
    schema does not have raises ConfigError naming ``section.field`` and the schema's fields."""
    key, registry = SECTIONS[section]
    if dataclasses.is_dataclass(node):
        node = OmegaConf.structured(node)
    elif not isinstance(node, DictConfig):
        node = OmegaConf.create(node)
    name = node.get(key) if OmegaConf.is_dict(node) and not OmegaConf.is_missing(node, key) and key in node else None
    if name is None and section == "env" and OmegaConf.is_dict(node) and "_target_" in node:
        name = "target"  # a user's env YAML with only ``_target_`` (envs/target.py)
    if name is None:
        raise ConfigError(f"{section}.{key} is required; choose one of {registry.names()}")
    schema = registry.get(name).config
    if OmegaConf.get_type(node) is schema:
        return node
    names = {f.name for f in dataclasses.fields(schema)}
    unused = [k for k in node.keys() if k not in names]
    if unused:
        raise ConfigError(f"{section}.{unused[0]} is not used by {registry.axis} {name!r} ({registry.key}={name}, "
                          f"schema {schema.__name__}); its fields: {sorted(names)}")
    try:
        return OmegaConf.merge(OmegaConf.structured(schema), node)
    except ConfigKeyError as e:  # a nested unknown key
        raise ConfigError(f"{section}: {e}") from None


def conform_sections(cfg: RunConfig) -> RunConfig:
    """Re-type each plugin section whose entry name was changed after composing (say
    ``model=tiny_moe model.family=llama``), or that came untyped from a user's own YAML; refuses
    fields the entry does not use."""
    changes = {}
    for section, (key, _registry) in SECTIONS.items():
        obj = getattr(cfg, section)
        if isinstance(obj, dict):  # a user's YAML without the schema in its defaults (hydra.searchpath)
            changes[section] = OmegaConf.to_object(structure_section(section, obj))
        elif type(obj) is not section_schema(section, getattr(obj, key)):
            changes[section] = OmegaConf.to_object(structure_section(section, OmegaConf.to_container(
                OmegaConf.structured(obj))))
    return dataclasses.replace(cfg, **changes) if changes else cfg


def load_run_config(path: str) -> RunConfig:
    """Load a resolved run.yaml onto the schema (type-checked), returning the dataclass.

    Imports the run's plugins first, so sections chosen by a plugin's entry load too."""
    raw = OmegaConf.load(path)
    load_plugins(list(raw.get("plugins") or []))
    for section in SECTIONS:
        if section in raw:
            raw[section] = structure_section(section, raw[section])
    merged = OmegaConf.merge(OmegaConf.structured(RunConfig), raw)
    cfg = OmegaConf.to_object(merged)
    check_fields(cfg, "", skip=SECTIONS)  # the plan's range checks again: a run.yaml edited by hand (ConfigError)
    return cfg  # type: ignore[return-value]


def to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg) if dataclasses.is_dataclass(cfg) else cfg)
