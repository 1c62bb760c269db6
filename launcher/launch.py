"""Plan -> run directory -> backend. Shared by the CLI, sweeps and tests (no Hydra needed here).

Order matters: :func:`prepare` does everything that can fail on user input (plan, choose
the run dir, render the sbatch script) without touching the disk; :func:`write` then
creates the run dir: ``config/run.yaml`` (what workers load), ``config/<role>.yaml`` (the
same resolved config, one per role, headed by its placement), ``config/plan.json`` and,
for Slurm, ``slurm/job.sbatch``. Only then is anything started or submitted.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Optional

from launcher import weights_dir
from launcher.estimate import human
from launcher.gpus import detect_gpus, gpu_hint
from launcher.host_checks import check_bind_host, check_dir_usable, check_run_target
from launcher.model_path import check_model_path, check_tensors
from launcher.plan import JobPlan, build_plan, plan_errors
from launcher.pretrained import ensure_converted, pin_pretrained_dir
from launcher.teacher import check_teacher
from launcher.render import render_script, sbatch_command
from launcher.resume import ensure_stopped, rewrite_run_dir
from launcher.run_dir import choose_run_dir, create_run_dir, run_label
from launcher.run_status import next_commands
from launcher.timeline import summary_line as timeline_summary
from workers.common.config import RunConfig
from workers.common.protocol import RunPaths
from workers.common.registry import ENVS


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A planned, rendered run that has not written anything yet."""

    cfg: RunConfig
    """The config with launcher.run_dir pinned to the chosen directory."""
    plan: JobPlan
    root: Path
    script: Optional[str]
    """The sbatch script (Slurm backend), else None."""
    weights_note: str = ""
    """Local backend: why published steps stay in the run directory although /dev/shm was the default."""

    @property
    def script_path(self) -> Path:
        return self.root / "slurm" / "job.sbatch"


def check_host(cfg: RunConfig) -> None:
    """The env's checks that need the machine its orchestrator runs on (EnvSpec.host_check)."""
    spec = ENVS.get(cfg.env.name)
    if spec.host_check is not None:
        with plan_errors():
            spec.host_check(cfg)


def prepare(cfg: RunConfig, *, root: Optional[Path] = None) -> Prepared:
    gpus = detect_gpus(cfg) if cfg.cluster.backend == "local" else None  # this machine's (NVML)
    plan = build_plan(cfg, gpus=gpus)  # every user mistake raises here, before anything is written
    check_dir_usable("cluster.runs_root", Path(cfg.cluster.runs_root))  # before choose_run_dir looks inside
    cfg, weights_note = weights_dir.resolve(cfg, has_gpus=bool(plan.gpu_placement), num_params=plan.num_params)
    if plan.backend == "local":
        check_bind_host("inference.host", cfg.inference.host)  # the local servers bind to it
        check_host(cfg)  # what only this machine can say (the roles run here)
    check_model_path(cfg)  # model.path: config.json, shards, tokenizer (torch-free)
    check_teacher(cfg)  # algorithm.teacher.path: a checkpoint with the student's tokenizer
    cfg = pin_pretrained_dir(cfg)  # a missing checkpoint package too
    if cfg.tracking.wandb and not cfg.tracking.wandb_project and run_label(cfg) != cfg.experiment:
        cfg = dataclasses.replace(cfg, tracking=dataclasses.replace(cfg.tracking, wandb_project=f"slurmrl-{run_label(cfg)}"))
    root = root or choose_run_dir(cfg)
    key = "launcher.resume" if cfg.launcher.resume else "launcher.run_dir" if cfg.launcher.run_dir else "cluster.runs_root"
    check_dir_usable(key, root)
    check_run_target(key, root, cfg.cluster.runs_root, resume=bool(cfg.launcher.resume))
    cfg = dataclasses.replace(cfg, launcher=dataclasses.replace(cfg.launcher, run_dir=str(root)))
    script = None
    if plan.backend == "slurm":
        python = cfg.cluster.python or sys.executable
        script = render_script(plan, run_dir=str(root), python=python, workdir=os.getcwd(),
                               script_path=str(root / "slurm" / "job.sbatch"))
    return Prepared(cfg=cfg, plan=plan, root=root, script=script, weights_note=weights_note)


def role_header(plan: JobPlan, role: str) -> str:
    r = plan.role(role)
    return (f"# Resolved config for role {role}: {r.description}; module {r.module}; "
            f"het group {r.het_group}, {r.num_procs} task(s) on {r.num_nodes} node(s).\n"
            f"# Workers load config/run.yaml (identical below this header) onto workers.common.config.RunConfig.\n")


def write(prep: Prepared) -> RunPaths:
    linked = prep.plan.backend == "local" and not prep.cfg.launcher.dry_run
    if prep.cfg.launcher.resume:
        if linked:  # before RunPaths.ensure: a link left dangling by a reboot gets its directory back
            weights_dir.link(prep.cfg, RunPaths(prep.root))
        paths = rewrite_run_dir(prep.cfg)
    else:
        paths = create_run_dir(prep.cfg)
        if linked:
            weights_dir.link(prep.cfg, paths)
    resolved = paths.run_config.read_text()
    for r in prep.plan.roles:
        (paths.config_dir / f"{r.role}.yaml").write_text(role_header(prep.plan, r.role) + resolved)
    (paths.config_dir / "plan.json").write_text(json.dumps(dataclasses.asdict(prep.plan), indent=1, default=str) + "\n")
    if prep.script is not None:
        prep.script_path.parent.mkdir(parents=True, exist_ok=True)
        prep.script_path.write_text(prep.script)
        prep.script_path.chmod(0o755)
    return paths


def announce(prep: Prepared) -> None:
    plan = prep.plan
    procs = ", ".join(f"{r.num_procs} {r.role}" for r in plan.roles)
    label = run_label(prep.cfg)
    labelled = f" (this run: {label})" if label != plan.experiment else ""
    print(f"[slurmrl] experiment {plan.experiment}{labelled}: {procs}; model {human(plan.num_params)} params; "
          f"{plan.samples_per_step} samples/step; run dir {prep.root}", flush=True)
    if plan.backend == "slurm":
        for line in plan.summary():
            print(f"[slurmrl]   {line}", flush=True)
        return
    for line in plan.summary():  # local runs: the model's path, the RL recipe's settings and the plan's warnings
        if line.startswith(("algorithm ", "WARNING ")) or line == f"model path: {plan.route}":
            print(f"[slurmrl]   {line}", flush=True)
    if plan.local_gpus is not None:
        hint = gpu_hint(prep.cfg, plan.local_gpus)
        if hint:
            print(f"[slurmrl] {hint}", flush=True)
        lines = [ln for ln in plan.summary() if ln.startswith("GPU")] + [weights_dir.line(prep.cfg, prep.root)]
        for line in lines + ([f"weights: {prep.weights_note}"] if prep.weights_note else []):
            print(f"[slurmrl]   {line}", flush=True)


def launch(cfg: RunConfig, *, follow: Optional[bool] = None) -> int:
    """``cfg.launcher.resume`` set (launcher/resume.py built cfg from the run's own run.yaml):
    the same run directory, its roles started again; otherwise a new run directory."""
    resuming = bool(cfg.launcher.resume)
    prep = prepare(cfg, root=Path(cfg.launcher.resume) if resuming else None)
    if resuming:
        ensure_stopped(prep.cfg, prep.root)
        if cfg.launcher.dry_run:
            announce(prep)
            print(f"[slurmrl] dry run: would resume {prep.root}; nothing written or started", flush=True)
            return 0
        print(f"[slurmrl] resuming {prep.root} (its config/run.yaml; trainer checkpoint, orchestrator ledger)",
              flush=True)
    if not cfg.launcher.dry_run:
        ensure_converted(prep.cfg)  # model.pretrained: once per cache dir, before the run dir exists
        check_tensors(prep.cfg)  # model.path: every tensor's name and shape (a child process with torch)
    paths = write(prep)
    announce(prep)
    if cfg.launcher.dry_run:
        if prep.script is not None:
            print(prep.script, end="", flush=True)
            print(f"[slurmrl] dry run: script {prep.script_path}, per-role configs in {paths.config_dir}; "
                  f"submit with: {shlex.join(sbatch_command(str(prep.script_path)))}", flush=True)
        else:
            print(f"[slurmrl] dry run: resolved config in {paths.run_config}; nothing started", flush=True)
        return 0
    if prep.plan.backend == "local":
        from launcher.local_backend import LocalBackend

        backend = LocalBackend(prep.cfg, prep.plan, paths)
        try:
            code = backend.run()
        finally:
            weights_dir.settle(paths)  # tmpfs steps back into the run directory, memory given back
        print(f"[slurmrl] {'finished' if code == 0 else 'stopped'}: {backend.progress_summary}", flush=True)
        if (line := timeline_summary(paths.root)) is not None:  # where the step interval went (launcher/timeline.py)
            print(f"[slurmrl] {line}", flush=True)
        print(f"[slurmrl] run directory: {paths.root}", flush=True)
        for line in next_commands(paths.root, finished=code == 0):
            print(f"[slurmrl]   {line}", flush=True)
        return code
    job_id = submit_prepared(prep)
    if not (cfg.launcher.follow if follow is None else follow):
        print(f"[slurmrl] follow with: slurmrl status {paths.root}", flush=True)
        return 0
    from launcher.submit import follow as follow_job

    return follow_job(job_id, paths, cfg.trainer.num_steps)


def submit_prepared(prep: Prepared) -> str:
    from launcher import submit

    job_id = submit.submit(prep.script_path)
    submit.record_job_id(prep.root, job_id)
    print(f"[slurmrl] submitted job {job_id} ({len(prep.plan.components)} het components); "
          f"logs in {prep.root / 'logs'}", flush=True)
    return job_id
