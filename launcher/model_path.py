"""Login-node side of ``model.path``: the model section comes from the checkpoint's config.json.

How it composes with Hydra's ``model=`` group (README, "Starting from a Hugging Face checkpoint"):
``slurmrl model.path=DIR`` composes as usual (the default preset, tiny_moe), then
:func:`resolve_model_path` REPLACES the model section by the schema of the family that
config.json's ``architectures`` names, filled from config.json (the spec's ``from_hf_config``).
The preset's values are dropped (they describe another model); what the command line sets
explicitly (``model.init_seed=7``, ``model.name=mine``) is kept, and an explicit value that
contradicts config.json (``model.num_layers=2`` for a 30-layer checkpoint) is refused naming both.
``model=<preset> model.path=DIR`` is refused: the preset would be silently replaced.

Then :func:`check_model_path` (every launch, resumes and Python-built configs included) re-reads
the directory: family and fields equal to config.json, every shard the index names present, a
tokenizer that fits the embedding; and, before roles start, :func:`check_tensors` runs
``python -m workers.models.hf_checkpoint check`` in a child process (this package never imports
torch): every tensor the model needs present, none unexpected, each of the right shape.
"""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterable

from launcher.resources import PlanError
from workers.common.config import RunConfig
from workers.common.config.run import to_yaml
from workers.models.hf_dir import CheckpointError, check_directory, model_fields

OVERRIDE = re.compile(r"^\+{0,2}(model(?:\.[\w]+)?)=")


def explicit_model_keys(overrides: Iterable[str]) -> set[str]:
    """Model keys the command line sets: ``{"path", "init_seed"}``; ``"model"`` for a ``model=`` choice."""
    out = set()
    for o in overrides:
        m = OVERRIDE.match(o)
        if m:
            out.add(m.group(1).split(".", 1)[1] if "." in m.group(1) else "model")
    return out


def resolve_model_path(cfg: RunConfig, explicit: set[str]) -> RunConfig:
    """``cfg`` with the model section rebuilt from ``model.path``'s config.json (no-op without one)."""
    m = cfg.model
    if not m.path:
        return cfg
    if "model" in explicit:
        raise PlanError(f"model.path={m.path} takes the family and architecture from its config.json; drop the "
                        f"model=<preset> choice (its fields would be replaced), or set model.* keys one by one")
    directory = Path(m.path).expanduser().resolve()
    try:
        spec, fields = model_fields(directory)
    except CheckpointError as e:
        raise PlanError(str(e)) from None
    names = {f.name for f in dataclasses.fields(spec.config)}
    kept = {}
    for key in sorted(explicit - {"path"}):
        value = getattr(m, key)
        if key not in names:
            raise PlanError(f"model.{key} is not a field of family {spec.name} ({directory}/config.json is "
                            f"{spec.hf_architectures[0]}); its fields: {sorted(names)}")
        if key == "family" and value != spec.name:
            raise PlanError(f"model.family={value} contradicts {directory}/config.json (family {spec.name})")
        if key in fields and value != fields[key]:
            raise PlanError(f"model.{key}={value!r} contradicts {directory}/config.json, which says {fields[key]!r}; "
                            f"drop the override (model.path takes the architecture from config.json)")
        kept[key] = value
    values = {"name": directory.name, **fields, **kept, "family": spec.name, "path": str(directory)}
    return dataclasses.replace(cfg, model=spec.config(**values))


def check_model_path(cfg: RunConfig) -> None:
    """PlanError unless ``model.path`` is a usable checkpoint that the model section describes."""
    m = cfg.model
    if not m.path:
        return
    try:
        check_directory(Path(m.path), m)
    except CheckpointError as e:
        raise PlanError(str(e)) from None


def check_tensors(cfg: RunConfig) -> None:
    """Every tensor's name and shape against the model the run builds (a child process with torch,
    reading only the safetensors headers); PlanError with its message (file and key) otherwise."""
    if not cfg.model.path:
        return
    cmd = [sys.executable, "-m", "workers.models.hf_checkpoint", "check", *cfg.plugins]
    proc = subprocess.run(cmd, input=to_yaml(cfg.model), capture_output=True, text=True)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        raise PlanError(lines[-1].removeprefix("error: ") if lines else f"{' '.join(cmd)} failed "
                        f"(exit {proc.returncode})")
