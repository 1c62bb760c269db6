"""Create a run directory: resolved config, per-run admin token, ``runs/latest`` symlink.

The directory is ``<cluster.runs_root>/<name>`` with ``name=`` (``-2``, ``-3`` ... when taken), else
``<label>-<date>-<time>`` (:func:`run_label`: the experiment, or what a bring-your-own run trains).
A dry run gets a ``DRY_RUN`` marker and leaves ``runs/latest`` where it was (it names the last run
that was started). A dry run does not take its name: it is a preview of the run the same command
starts, so that run replaces it (``name=x launcher.dry_run=true`` then ``name=x`` gives ``x``, not ``x-2``).

Nothing is written before the plan succeeded, and an existing run directory is never
overwritten (an explicit ``launcher.run_dir`` that already holds a run is refused).
"""
from __future__ import annotations

import dataclasses
import os
import re
import secrets
import shutil
import time
from pathlib import Path

from omegaconf import OmegaConf

from launcher.run_status import DRY_RUN_MARKER, mark_dry_run
from workers.common.config import RunConfig
from workers.common.protocol import RunPaths


class RunDirError(ValueError):
    """The run directory cannot be used; the message names launcher.run_dir."""


def run_label(cfg: RunConfig) -> str:
    """What the run is called where no ``name=`` was given (default run name, Slurm job name, W&B
    project): the experiment, except the default ``tiny_local`` bundle turned into a bring-your-own
    run (``model.path`` or ``env=dataset``), which is labelled ``<model>-<env>`` (``my-llama-dataset``),
    not after a toy it no longer is."""
    if cfg.experiment != "tiny_local" or not (cfg.model.path or cfg.env.name == "dataset"):
        return cfg.experiment
    label = f"{cfg.model.name or cfg.model.family}-{cfg.env.name}"
    return re.sub(r"[^A-Za-z0-9._+-]", "_", label).lstrip(".-")[:80] or cfg.experiment


def is_dry_preview(path: Path) -> bool:
    """A directory a dry run wrote and nothing ever ran in (no step logged, no launcher pids)."""
    return (path / DRY_RUN_MARKER).is_file() and not (path / "metrics.jsonl").exists() \
        and not (path / "pids.json").exists() and (path / "config" / "run.yaml").is_file()


def free_dir(base: Path) -> Path:
    """``base``, else ``base-2``, ``base-3`` ...: the first that does not exist or is only a dry run's preview."""
    path, n = base, 1
    while path.exists() and not is_dry_preview(path):
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def choose_run_dir(cfg: RunConfig) -> Path:
    if cfg.launcher.run_dir:
        return Path(cfg.launcher.run_dir).expanduser().resolve()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return free_dir(Path(cfg.cluster.runs_root).expanduser().resolve() / (cfg.name or f"{run_label(cfg)}-{stamp}"))


def create_run_dir(cfg: RunConfig) -> RunPaths:
    """Make the directory tree, write config/run.yaml and the admin token (mode 600)."""
    root = choose_run_dir(cfg)
    if is_dry_preview(root):  # the preview of this run: the run takes its place
        shutil.rmtree(root)
    if (root / "config" / "run.yaml").exists():
        raise RunDirError(f"launcher.run_dir={str(root)!r} already holds a run; pick a new directory")
    paths = RunPaths(root).ensure()
    resolved = dataclasses.replace(cfg, launcher=dataclasses.replace(cfg.launcher, run_dir=str(root)))
    paths.run_config.write_text(OmegaConf.to_yaml(OmegaConf.structured(resolved)))
    fd = os.open(paths.admin_token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(24))
    if cfg.launcher.dry_run:  # runs/latest keeps naming the last real run (slurmrl-eval runs/latest/...)
        mark_dry_run(root)
    else:
        update_latest_link(Path(cfg.cluster.runs_root).expanduser().resolve(), root)
    return paths


def update_latest_link(runs_root: Path, root: Path) -> None:
    """Point ``<runs_root>/latest`` at this run (atomic symlink swap), also for explicit run dirs."""
    runs_root.mkdir(parents=True, exist_ok=True)
    tmp = runs_root / f".latest.{os.getpid()}"
    if tmp.is_symlink():
        tmp.unlink()
    target = root.name if root.parent == runs_root else str(root)
    os.symlink(target, tmp)
    os.replace(tmp, runs_root / "latest")
