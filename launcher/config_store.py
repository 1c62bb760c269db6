"""Register the run schema and every plugin entry's schema in Hydra's ConfigStore; refuse unknown keys.

Schemas of the plugin sections (workers/common/registry.py SECTIONS) are stored as
``schema/<group>/<name>``; a packaged YAML option extends its entry's schema through its
defaults list (``- /schema/env/code_repair@_here_``). An entry with no YAML of its own (a plugin,
or a family without a preset) is also stored as the group option ``<group>/<name>``, so
``env=my_env`` works with the dataclass defaults alone.

The schema makes Hydra reject unknown keys on plain overrides, but ``+key=value`` (Hydra's
"add a key" operator) slips past struct mode and OmegaConf.to_object then drops the key
silently: a typo such as ``+orchestrator.batch=4`` would run with the default. Since every
valid key is in the schema, any key outside it is a mistake: :func:`reject_unknown_keys`.
"""
from __future__ import annotations

import dataclasses
import typing
from importlib import resources

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from launcher.override_keys import did_you_mean
from workers.common.config import RunConfig
from workers.common.plugins import load_plugins
from workers.common.registry import SECTIONS


def _has_yaml(group: str, name: str) -> bool:
    return resources.files("hydra_conf").joinpath(group, f"{name}.yaml").is_file()


def register() -> list[str]:
    """Import plugins (SLURMRL_PLUGINS, entry points), then store every schema; returns the plugin modules."""
    plugins = load_plugins()
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    for _section, (_key, registry) in SECTIONS.items():
        for spec in registry.specs():
            cs.store(group=f"schema/{registry.group}", name=spec.name, node=spec.config)
            if not _has_yaml(registry.group, spec.name):
                cs.store(group=registry.group, name=spec.name, node=spec.config)
    return plugins


def reject_unknown_keys(cfg: DictConfig, schema: type = RunConfig, prefix: str = "") -> None:
    """Raise KeyError naming the first key of ``cfg`` that ``schema`` has no field for.

    Plugin sections are checked against the schema their node was composed with."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema)
    for key in cfg.keys():
        if key == "hydra":
            continue
        full = f"{prefix}{key}"
        if key not in fields:
            hint = " (an env class of your own: env=target env._target_=my_pkg.envs:MyEnv)" if full == "env._target_" else ""
            guess = did_you_mean(str(key), sorted(fields))
            hint += f"; did you mean {prefix}{guess}?" if guess else ""
            raise KeyError(f"{full} is not a config key{hint}; valid keys under {prefix.rstrip('.') or 'the root'}: "
                           f"{sorted(fields)}")
        sub = hints[key]
        if OmegaConf.is_dict(cfg[key]):
            node_type = OmegaConf.get_type(cfg[key])
            if dataclasses.is_dataclass(node_type):
                sub = node_type
            if dataclasses.is_dataclass(sub):
                reject_unknown_keys(cfg[key], sub, prefix=f"{full}.")
