"""Launcher section: what the login-node side does, and Slurm resources of the CPU roles."""
from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Optional

from workers.common.config.ranges import LINE, NONEMPTY, ConfigError, ge, gt, limits, one_of


@dataclasses.dataclass(kw_only=True)
class RoleResources:
    """Slurm resources of a single-task CPU role (orchestrator, router)."""

    num_cpus_per_task: int = 1
    """CPUs of the task (--cpus-per-task)."""
    mem_gb: int = 0
    """Memory of the task's node in GB (0: the cluster default)."""


@dataclasses.dataclass(kw_only=True)
class TrainerLayout:
    """Trainer placement on Slurm: nodes and resources (the parallel layout is ``trainer.parallel``)."""

    num_nodes: int = 1
    """Nodes of the trainer component; on GPU clusters one rank per GPU."""
    num_cpus_per_task: int = 1
    """CPUs per trainer rank."""
    mem_gb: int = 0
    """Memory per trainer node in GB (0: the cluster default)."""


@dataclasses.dataclass(kw_only=True)
class LauncherConfig:
    dry_run: bool = False
    """Render configs (and the sbatch script) and print the submit command; start nothing."""
    run_dir: Optional[str] = None
    """Explicit run directory; None creates runs_root/<experiment>-<timestamp>."""
    shutdown_grace_s: float = 10.0
    """On Ctrl-C or a dead role: seconds between SIGTERM and SIGKILL for each child."""
    max_restarts: int = 2
    """Local backend: times EACH process (inference worker, trainer rank, orchestrator) is
    restarted after a non-zero exit or a kill before the run stops; 0 is fail-fast. They resume
    from the trainer checkpoint / orchestrator ledger; a respawned worker loads the newest weights."""
    hung_worker_kill_s: float = 60.0
    """An inference worker the orchestrator marked dead while its process still runs (hung: SIGSTOP,
    a wedged GPU, a deadlock) is killed after this many seconds (SIGKILL by PID; on Slurm its
    step) and restarted like a crashed one; 0: never (``run_dir/inference_health.json``)."""
    resume: Optional[str] = None
    """Run directory of a stopped or killed run to continue from its last checkpoint and ledger,
    with its own config/run.yaml (launcher/resume.py: which overrides a resume accepts)."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ConfigError(f"launcher.max_restarts({self.max_restarts}) must be >= 0 (0: a dead process stops the run)")
    control_placement: str = "own_node"
    """Where the orchestrator and router run on Slurm: ``own_node`` (a CPU het group of their own,
    one extra node) or ``trainer`` (extra steps on the trainer's first node, ``srun --overlap``:
    the job uses exactly its GPU nodes)."""
    job_name: str = ""
    """Slurm job name; "" = ``slurmrl-<experiment>``. A sweep names each point's job
    ``slurmrl-<experiment>-<hash>-<swept values>`` (launcher/sweep.py)."""
    follow: bool = True
    """Slurm: after sbatch, print per-step progress until the job ends; False submits and returns."""
    num_gpu_nodes: int = 0
    """Expected GPU nodes of the whole job (0: no check); the plan refuses components that differ."""
    orchestrator: RoleResources = field(default_factory=RoleResources)
    """Slurm resources of the orchestrator task."""
    router: RoleResources = field(default_factory=RoleResources)
    """Slurm resources of the router task (sglang-router; absent with embedded inference)."""
    trainer: TrainerLayout = field(default_factory=TrainerLayout)
    """Nodes and parallel dimensions of the trainer ranks."""
    local_weights_dir: str = "auto"
    """Local backend: where published weight steps live (run_dir/weights links there; moved into the run
    directory when the run ends): ``auto`` (/dev/shm/slurmrl when the roles have GPUs: one node, tmpfs),
    ``run_dir`` (the run directory itself) or a directory (launcher/weights_dir.py)."""


limits(RoleResources, num_cpus_per_task=gt(0), mem_gb=ge(0))
limits(TrainerLayout, num_nodes=gt(0), num_cpus_per_task=gt(0), mem_gb=ge(0))
limits(LauncherConfig, run_dir=LINE, resume=LINE, job_name=LINE, control_placement=one_of("own_node", "trainer"),
       shutdown_grace_s=ge(0), max_restarts=ge(0), num_gpu_nodes=ge(0), local_weights_dir=NONEMPTY,
       hung_worker_kill_s=ge(0))
