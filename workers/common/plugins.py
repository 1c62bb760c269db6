"""Import plugin modules so their specs register (workers/common/registry.py).

Where plugins come from, in this order (each module imported once per process):
- ``SLURMRL_PLUGINS``: comma-separated module names, read by the launcher before Hydra composes
  (so a plugin's config schema is a Hydra group option like a builtin's);
- the run config's ``plugins`` list: the launcher writes the union of both into run.yaml, and
  every role imports them before it loads its config (compute nodes need no environment variable);
- installed packages' entry points in the group ``slurmrl.plugins`` (each names a module).
"""
from __future__ import annotations

import importlib
import os
from importlib import metadata
from typing import Iterable

ENV_VAR = "SLURMRL_PLUGINS"
ENTRY_POINT_GROUP = "slurmrl.plugins"


def env_plugins() -> list[str]:
    return [m.strip() for m in os.environ.get(ENV_VAR, "").split(",") if m.strip()]


def entry_point_plugins() -> list[str]:
    return [ep.value.split(":")[0] for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)]


def load_plugins(extra: Iterable[str] = ()) -> list[str]:
    """Import every plugin module; returns their names in load order (for run.yaml's ``plugins``).

    A module that cannot be imported is a user error: the message names it and where it came from.
    """
    names: list[str] = []
    for source, mods in ((ENV_VAR, env_plugins()), ("plugins", list(extra)), (ENTRY_POINT_GROUP, entry_point_plugins())):
        for mod in mods:
            if mod in names:
                continue
            try:
                importlib.import_module(mod)
            except ImportError as e:
                raise ValueError(f"plugin module {mod!r} (from {source}) cannot be imported: {e}") from e
            names.append(mod)
    return names
