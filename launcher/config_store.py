"""Register the run schema in Hydra's ConfigStore; refuse keys the schema does not know.

The schema makes Hydra reject unknown keys on plain overrides, but ``+key=value`` (Hydra's
"add a key" operator) slips past struct mode and OmegaConf.to_object then drops the key
silently: a typo such as ``+orchestrator.batch=4`` would run with the default. Since every
valid key is in the schema, any key outside it is a mistake: :func:`reject_unknown_keys`.
"""
from __future__ import annotations

import dataclasses
import typing

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from workers.common.config import RunConfig


def register() -> None:
    ConfigStore.instance().store(name="run_schema", node=RunConfig)


def reject_unknown_keys(cfg: DictConfig, schema: type = RunConfig, prefix: str = "") -> None:
    """Raise KeyError naming the first key of ``cfg`` that ``schema`` has no field for."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema)
    for key in cfg.keys():
        if key == "hydra":
            continue
        full = f"{prefix}{key}"
        if key not in fields:
            raise KeyError(f"{full} is not a config key; valid keys under {prefix.rstrip('.') or 'the root'}: "
                           f"{sorted(fields)}")
        sub = hints[key]
        if dataclasses.is_dataclass(sub) and OmegaConf.is_dict(cfg[key]):
            reject_unknown_keys(cfg[key], sub, prefix=f"{full}.")
