"""Register the run schema in Hydra's ConfigStore so every YAML is type-checked against it."""
from __future__ import annotations

from hydra.core.config_store import ConfigStore

from workers.common.config import RunConfig


def register() -> None:
    ConfigStore.instance().store(name="run_schema", node=RunConfig)
