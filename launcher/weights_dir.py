"""Where a local run's published weight steps live: ``/dev/shm`` on a GPU node (``launcher.local_weights_dir``).

Why: on one node every reader of ``run_dir/weights/step_N`` (the engines, SGLang's
``/update_weights_from_disk``) is on the same machine, so the steps need no shared or durable
filesystem: tmpfs takes the write + fsync of every step off the disk. How, without touching
the transports: ``run_dir/weights`` becomes a symlink to ``<dir>/<run dir name>/weights``;
publishers, receivers and retention keep using ``run_dir/weights`` as on any filesystem.

When the run ends (finished, stopped, a role failed) :func:`settle` moves the kept steps back
into a real ``run_dir/weights`` (a delta step's references stay valid: every kept step moves)
and removes the tmpfs copy, so memory is given back and the run directory holds its weights
as with any other transport. A resumed run then publishes to disk (its weights are there).

``launcher.local_weights_dir``: ``auto`` (``/dev/shm/slurmrl`` when the local roles have GPUs and
/dev/shm exists, else the run directory), ``run_dir`` (never elsewhere) or a directory.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Optional

from workers.common.config import RunConfig
from workers.common.protocol import WEIGHTS_DIR, RunPaths

SHM = Path("/dev/shm")
SHM_ROOT = SHM / "slurmrl"


def resolve(cfg: RunConfig, *, has_gpus: bool, num_params: int = 0, shm: Path = SHM) -> tuple[RunConfig, str]:
    """(``cfg`` with ``launcher.local_weights_dir`` made concrete: ``run_dir`` or a directory, so run.yaml
    says where the steps went; why ``auto`` stayed in the run directory, or ""). Slurm runs keep
    theirs in the run directory. ``auto`` needs room in /dev/shm for ``weights.keep_last`` + 1 steps of
    ``num_params`` at 4 bytes (a container's /dev/shm is often 64 MB)."""
    choice, note = cfg.launcher.local_weights_dir, ""
    if cfg.cluster.backend != "local":
        choice = "run_dir"
    elif choice == "auto":
        choice = "run_dir"
        if has_gpus and shm.is_dir():
            st = os.statvfs(shm)
            free, need = st.f_bavail * st.f_frsize, num_params * 4 * (cfg.weights.keep_last + 1)
            if free >= need:
                choice = str(shm / "slurmrl")
            else:
                note = (f"{shm} has {free / 1e9:.1f} GB free < {need / 1e9:.1f} GB for weights.keep_last"
                        f"({cfg.weights.keep_last}) + 1 steps: published steps stay in the run directory")
    return dataclasses.replace(cfg, launcher=dataclasses.replace(cfg.launcher, local_weights_dir=choice)), note


def target(cfg: RunConfig, root: Path) -> Optional[Path]:
    """Where ``root/weights`` points (None: it is a plain directory of the run)."""
    choice = cfg.launcher.local_weights_dir
    if choice in ("auto", "run_dir"):
        return None
    return Path(choice).expanduser().resolve() / root.name / WEIGHTS_DIR


def line(cfg: RunConfig, root: Path) -> str:
    """The plan's line: where steps are published and why."""
    where = target(cfg, root)
    if where is None:
        return f"weights: published steps in {root / WEIGHTS_DIR} (launcher.local_weights_dir=run_dir)"
    tmpfs = " (tmpfs: memory of this node)" if str(where).startswith(str(SHM)) else ""
    return (f"weights: published steps in {where}{tmpfs}, linked as run_dir/weights; moved into the run "
            f"directory when the run ends (launcher.local_weights_dir)")


def link(cfg: RunConfig, paths: RunPaths) -> None:
    """Point ``run_dir/weights`` at the chosen directory (before any role starts). A resumed run
    whose steps are already in the run directory keeps them there."""
    where = target(cfg, paths.root)
    weights = paths.root / WEIGHTS_DIR
    if where is None:
        return
    if weights.is_symlink():
        Path(weights.readlink()).mkdir(parents=True, exist_ok=True)  # gone after a reboot: steps come again
        return
    if weights.is_dir() and any(weights.iterdir()):
        return
    where.mkdir(parents=True, exist_ok=True)
    if weights.is_dir():
        weights.rmdir()
    weights.symlink_to(where, target_is_directory=True)


def settle(paths: RunPaths) -> Optional[Path]:
    """Move the steps from the linked directory into a real ``run_dir/weights``; returns where they
    were (None: nothing linked)."""
    weights = paths.root / WEIGHTS_DIR
    if not weights.is_symlink():
        return None
    where = Path(weights.readlink())
    tmp = paths.root / f".{WEIGHTS_DIR}.settling"
    if tmp.exists():
        shutil.rmtree(tmp)
    if where.is_dir():
        shutil.copytree(where, tmp, symlinks=True)
    else:
        tmp.mkdir()
    weights.unlink()
    tmp.rename(weights)
    shutil.rmtree(where.parent if where.parent.name == paths.root.name else where, ignore_errors=True)
    return where
