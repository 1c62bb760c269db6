"""Login-node side of ``model.path``: the model section comes from the checkpoint's config.json.

How it composes with Hydra's ``model=`` group (docs/design.md, "Hugging Face checkpoints in and out"):
``slurmrl model.path=DIR`` composes as usual (the default preset, tiny_moe), then
:func:`resolve_model_path` REPLACES the model section by the schema of the family that
config.json's ``architectures`` names, filled from config.json (the spec's ``from_hf_config``).
The preset's values are dropped (they describe another model); what the command line sets
explicitly (``model.init_seed=7``, ``model.name=mine``) is kept, and an explicit value that
contradicts config.json (``model.num_layers=2`` for a 30-layer checkpoint) is refused naming both.
``model=<preset> model.path=DIR`` is refused: the preset would be silently replaced.

A hub id (``model.path=Qwen/Qwen3-8B``, not an existing path) is first resolved to its snapshot
directory in the Hugging Face cache every node mounts, downloaded once if needed (launcher/hub.py).

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

from launcher.hub import resolve_hub_path
from launcher.resources import PlanError
from workers.common.config import RunConfig
from workers.common.config.run import to_yaml
from workers.common.registry import ENVS
from workers.models.hf_dir import CheckpointError, check_directory, model_fields

OVERRIDE = re.compile(r"^\+{0,2}(model(?:\.[\w]+)?)=")
SERVER_PATH = re.compile(r"^\+{0,2}inference\.sglang\.model_path=")


def explicit_model_keys(overrides: Iterable[str]) -> set[str]:
    """Model keys the command line sets: ``{"path", "init_seed"}``; ``"model"`` for a ``model=`` choice."""
    out = set()
    for o in overrides:
        m = OVERRIDE.match(o)
        if m:
            out.add(m.group(1).split(".", 1)[1] if "." in m.group(1) else "model")
    return out


def explicit_server_path(overrides: Iterable[str]) -> bool:
    """Whether the command line sets ``inference.sglang.model_path`` itself."""
    return any(SERVER_PATH.match(o) for o in overrides)


def resolve_model_path(cfg: RunConfig, explicit: set[str], server_path_explicit: bool = False) -> RunConfig:
    """``cfg`` with the model section rebuilt from ``model.path``'s config.json (no-op without one), and
    the SGLang servers pointed at the same checkpoint (:func:`servers_load_model_path`)."""
    m = cfg.model
    if not m.path:
        return cfg
    if "model" in explicit:
        raise PlanError(f"model.path={m.path} takes the family and architecture from its config.json; drop the "
                        f"model=<preset> choice (its fields would be replaced), or set model.* keys one by one")
    cfg, repo_name = resolve_hub_path(cfg)  # a hub id: its snapshot in the shared HF cache (launcher/hub.py)
    m = cfg.model
    directory = Path(m.path).expanduser().resolve()
    try:
        spec, fields = model_fields(directory)
    except CheckpointError as e:
        raise PlanError(named("model.path", m.path, str(e))) from None
    names = {f.name for f in dataclasses.fields(spec.config)}
    kept, problems = {}, []
    for key in sorted(explicit - {"path"}):
        value = getattr(m, key)
        if key not in names:
            problems.append(f"model.{key} is not a field of family {spec.name} ({directory}/config.json is "
                            f"{spec.hf_architectures[0]})")
        elif key == "family" and value != spec.name:
            problems.append(f"model.family={value} contradicts {directory}/config.json (family {spec.name})")
        elif key in fields and value != fields[key]:
            problems.append(f"model.{key}={value!r} contradicts {directory}/config.json, which says {fields[key]!r}")
        else:
            kept[key] = value
    values = {"name": repo_name or directory.name, **fields, **kept, "family": spec.name, "path": str(directory)}
    resolved = dataclasses.replace(cfg, model=spec.config(**values))
    if problems:
        message = checkpoint_overrides_message(directory, problems, sorted(fields), sorted(names - set(fields)))
        raise PlanError(message + env_problems(resolved))
    return servers_load_model_path(resolved, server_path_explicit)


def servers_load_model_path(cfg: RunConfig, explicit: bool) -> RunConfig:
    """``model.path`` is the run's one checkpoint: the trainer starts from it and SGLang servers load
    it too. A preset's ``inference.sglang.model_path`` (the glm5 / kimi_k2 / nemotron3 experiments
    name ``${cluster.shared_root}/models/<name>``) is replaced by it; one set on the command line that
    names another directory is refused with both keys (the trainer would train one model while the
    servers sample another)."""
    sglang = getattr(cfg.inference, "sglang", None)
    if not cfg.model.path or cfg.inference.backend != "sglang" or sglang is None:
        return cfg
    mine = str(Path(cfg.model.path).expanduser().resolve())
    theirs = sglang.model_path
    if theirs and str(Path(theirs).expanduser().resolve()) == mine:
        return cfg
    if theirs and explicit:
        raise PlanError(f"model.path={cfg.model.path} and inference.sglang.model_path={theirs} name different "
                        f"checkpoints: the trainer starts from model.path while the SGLang servers load theirs; "
                        f"set model.path alone (the servers then load it too)")
    inference = dataclasses.replace(cfg.inference, sglang=dataclasses.replace(sglang, model_path=mine))
    return dataclasses.replace(cfg, inference=inference)


def env_problems(cfg: RunConfig) -> str:
    """The env's plan check against the checkpoint as config.json describes it, so a refused override
    and what the env needs of the model (vocabulary, context) are reported together, not one per try."""
    try:
        ENVS.get(cfg.env.name).check(cfg)
    except ValueError as e:
        return f"\nand with config.json's values, env={cfg.env.name}: {e}"
    return ""


def checkpoint_overrides_message(directory: Path, problems: list[str], from_config: list[str],
                                 settable: list[str]) -> str:
    """Every refused model.* override at once, with which keys a checkpoint takes from its config.json
    (drop those overrides; to change one, rebuild the checkpoint) and which ones apply to it."""
    head = problems[0] if len(problems) == 1 else f"{len(problems)} model.* overrides do not apply to {directory}:\n" + \
        "\n".join(f"  - {p}" for p in problems)
    settable = [k for k in settable if k not in ("family", "path", "pretrained", "pretrained_dir")]
    return (f"{head}\nmodel.path takes the architecture from config.json ({', '.join(from_config)}): drop those "
            f"overrides (to change one, rebuild the checkpoint). Overrides that apply to a checkpoint: "
            f"{', '.join(f'model.{k}' for k in settable)}")


def named(key: str, value: str, message: str) -> str:
    """``message`` led by ``key=value`` (a checkpoint's messages name the file, not the key that chose it)."""
    return message if message.startswith(key) else f"{key}={value}: {message}"


def check_model_path(cfg: RunConfig) -> None:
    """PlanError unless ``model.path`` is a usable checkpoint that the model section describes."""
    m = cfg.model
    if not m.path:
        return
    try:
        check_directory(Path(m.path), m)
    except CheckpointError as e:
        raise PlanError(named("model.path", m.path, str(e))) from None


def check_tensors(cfg: RunConfig) -> None:
    """Every tensor's name and shape against the model the run builds (a child process with torch,
    reading only the safetensors headers); PlanError with its message (file and key) otherwise."""
    if not cfg.model.path:
        return
    cmd = [sys.executable, "-m", "workers.models.hf_checkpoint", "check", *cfg.plugins]
    proc = subprocess.run(cmd, input=to_yaml(cfg.model), capture_output=True, text=True)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        raise PlanError(named("model.path", cfg.model.path, lines[-1].removeprefix("error: ") if lines else
                              f"{' '.join(cmd)} failed (exit {proc.returncode})"))
