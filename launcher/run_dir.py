"""Create a run directory: resolved config, per-run admin token, ``runs/latest`` symlink.

The directory is ``<cluster.runs_root>/<name>`` with ``name=`` (``-2``, ``-3`` ... when taken), else
``<experiment>-<date>-<time>``. A dry run gets a ``DRY_RUN`` marker and leaves ``runs/latest``
where it was (it names the last run that was started).

Nothing is written before the plan succeeded, and an existing run directory is never
overwritten (an explicit ``launcher.run_dir`` that already holds a run is refused).
"""
from __future__ import annotations

import dataclasses
import os
import secrets
import time
from pathlib import Path

from omegaconf import OmegaConf

from launcher.run_status import mark_dry_run
from workers.common.config import RunConfig
from workers.common.protocol import RunPaths


class RunDirError(ValueError):
    """The run directory cannot be used; the message names launcher.run_dir."""


def choose_run_dir(cfg: RunConfig) -> Path:
    if cfg.launcher.run_dir:
        return Path(cfg.launcher.run_dir).expanduser().resolve()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(cfg.cluster.runs_root).expanduser().resolve() / (cfg.name or f"{cfg.experiment}-{stamp}")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def create_run_dir(cfg: RunConfig) -> RunPaths:
    """Make the directory tree, write config/run.yaml and the admin token (mode 600)."""
    root = choose_run_dir(cfg)
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
