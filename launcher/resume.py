"""Resume a stopped or killed run: ``slurmrl launcher.resume=<run_dir> [safe overrides]``.

Why this works without new worker code: every role already continues from the files of its
run directory after a restart (the trainer from its newest complete checkpoint,
workers/trainer/checkpoint.py; the orchestrator from its ledger, workers/orchestrator/ledger.py;
a worker loads the newest published weights). Resuming a run is therefore starting the same
roles again in the same directory with the same resolved config (``config/run.yaml``): locally
as new processes, on Slurm as a new job for the same run_dir.

What a resume may change: only :data:`SAFE_KEYS` (how long to train and how the launcher
supervises); any other override would change the run's shape under the checkpoint and the
ledger (model, batch geometry, env, parallel layout...) and is refused with its key named.
A run is resumed only once nothing of it is alive: a launcher still following it is refused,
children left by a SIGKILLed launcher are given the grace period to checkpoint and exit.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from launcher.run_dir import RunDirError, update_latest_link
from workers.common.config import RunConfig, load_run_config
from workers.common.protocol import RunPaths

SAFE_KEYS = {
    "launcher.resume": "the run to resume",
    "trainer.num_steps": "train further; never below the run's own value",
    "launcher.max_restarts": "supervision of the resumed processes",
    "launcher.shutdown_grace_s": "supervision of the resumed processes",
    "launcher.follow": "Slurm: follow the new job or return",
    "launcher.dry_run": "print what would start, write nothing",
    "cluster.runs_root": "where runs/latest points (the run stays where it is)",
}
CHILD_EXIT_WAIT_S = 10.0  # beyond shutdown_grace_s: a SIGTERMed trainer is still writing its checkpoint


def override_key(override: str) -> str:
    """``+a.b=1`` / ``~a.b`` / ``a.b=1`` / ``group=option`` -> ``a.b`` / ``group``."""
    return override.lstrip("+~").split("=", 1)[0].strip()


def resume_config(composed: RunConfig, overrides: list[str]) -> RunConfig:
    """The run's own config with the safe overrides applied; refuses anything else, naming the key.

    ``composed`` is the config Hydra built from the command line: the values of the safe keys
    the user overrode are taken from it (already typed and checked by the schema)."""
    root = resume_root(composed.launcher.resume)
    bad = [k for k in map(override_key, overrides) if k not in SAFE_KEYS]
    if bad:
        raise RunDirError(f"launcher.resume: {bad[0]} cannot be changed when resuming {root} (the run keeps its own "
                          f"config/run.yaml: model, batch, env and layout must match its checkpoint and ledger); "
                          f"allowed: {', '.join(sorted(SAFE_KEYS))}")
    cfg = load_run_config(str(root / "config" / "run.yaml"))
    own = cfg.trainer.num_steps
    given = {override_key(o) for o in overrides}
    for key in sorted(given - {"launcher.resume"}):
        section, field = key.split(".", 1)
        value = getattr(getattr(composed, section), field)
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{field: value})})
    if cfg.trainer.num_steps < own:
        raise RunDirError(f"trainer.num_steps({cfg.trainer.num_steps}) < the run's own {own}: a resume may only "
                          f"train further")
    done = root / "TRAINER_DONE"
    if done.exists() and cfg.trainer.num_steps <= own:
        raise RunDirError(f"launcher.resume: {root} already finished its {own} steps ({done}); raise "
                          f"trainer.num_steps to train further")
    return dataclasses.replace(cfg, plugins=list(dict.fromkeys([*composed.plugins, *cfg.plugins])),
                               launcher=dataclasses.replace(cfg.launcher, run_dir=str(root), resume=str(root)))


def resume_root(value: Optional[str]) -> Path:
    if not value:
        raise RunDirError("launcher.resume: name the run directory to resume")
    root = Path(value).expanduser().resolve()
    try:
        if not (root / "config" / "run.yaml").is_file():
            raise RunDirError(f"launcher.resume={value!r}: {root} holds no run (no config/run.yaml)")
        with open(root / "config" / "run.yaml", "rb"):
            pass
    except OSError as e:  # a run dir (or its config) this user may not read
        raise RunDirError(f"launcher.resume={value!r}: {root} cannot be read: {e.strerror or e} (check its "
                          f"permissions for this user)") from None
    return root


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _runs_here(pid: int, root: Path) -> bool:
    """True while ``pid`` is a live process of this run (its environment names the run dir)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            if fh.read().split(")")[-1].split()[0] == "Z":
                return False
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"SLURMRL_RUN_DIR={root}".encode() in env


def ensure_stopped(cfg: RunConfig, root: Path) -> None:
    """Refuse while a launcher of this run is alive; wait for children a killed launcher left
    (PR_SET_PDEATHSIG sent them SIGTERM: the trainer checkpoints on its way out)."""
    try:
        pids = json.loads((root / "pids.json").read_text())
    except (OSError, ValueError):
        pids = {}
    launcher = pids.get("launcher")
    if isinstance(launcher, int) and launcher != os.getpid() and "launcher" in _cmdline(launcher):
        raise RunDirError(f"launcher.resume: {root} is still running (launcher pid {launcher}); stop it first "
                          f"(Ctrl-C or kill {launcher})")
    children = {n: p for n, p in (pids.get("children") or {}).items() if isinstance(p, int)}
    deadline = time.monotonic() + cfg.launcher.shutdown_grace_s + CHILD_EXIT_WAIT_S
    while True:
        alive = {n: p for n, p in children.items() if _runs_here(p, root)}
        if not alive:
            break
        if time.monotonic() > deadline:
            raise RunDirError(f"launcher.resume: processes of {root} are still alive: {alive}; stop them first")
        time.sleep(0.2)
    if cfg.cluster.backend == "slurm" and (root / "slurm" / "job_id").exists():
        from launcher import submit

        job_id = submit.read_job_id(root)
        try:
            state = submit.overall_state(submit.components(job_id))
        except submit.SubmitError as e:
            if "unknown to scontrol and sacct" not in str(e):
                raise
            state = "UNKNOWN"
        if state in submit.ACTIVE:
            raise RunDirError(f"launcher.resume: job {job_id} of {root} is {state}; cancel it first "
                              f"(slurmrl cancel {root})")


def rewrite_run_dir(cfg: RunConfig) -> RunPaths:
    """The resume's counterpart of run_dir.create_run_dir: the same directory, its run.yaml
    rewritten with the safe overrides (``launcher.resume`` cleared: run.yaml stays the run's
    own config), the admin token kept, ``runs/latest`` pointed at it again."""
    root = Path(cfg.launcher.run_dir)
    paths = RunPaths(root).ensure()
    own = dataclasses.replace(cfg, launcher=dataclasses.replace(cfg.launcher, resume=None))
    paths.run_config.write_text(OmegaConf.to_yaml(OmegaConf.structured(own)))
    if not paths.admin_token.exists():
        raise RunDirError(f"launcher.resume: {paths.admin_token} is missing; the run cannot be resumed")
    update_latest_link(Path(cfg.cluster.runs_root).expanduser().resolve(), root)
    prepare_dir(cfg, root)
    return paths


def prepare_dir(cfg: RunConfig, root: Path) -> None:
    """Before the roles start again: a run that finished and now trains further must not look done."""
    done = root / "TRAINER_DONE"
    if done.exists():
        done.unlink()
    record = {"time": time.time(), "pid": os.getpid(), "num_steps": cfg.trainer.num_steps}
    with open(root / "launcher_resumes.jsonl", "a") as fh:
        fh.write(json.dumps(record) + "\n")
