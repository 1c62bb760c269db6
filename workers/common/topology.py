"""Where am I and where are my peers: the ONLY module that reads SLURM_* / RANK / MASTER_* env.

Every role calls :func:`current_topology` once and passes the result around. Two sources:

- local backend: the launcher exports ``SLURMRL_*`` variables for each child it spawns
  (role, rank, worker URLs, trainer master address) plus torchrun-style RANK/WORLD_SIZE.
- Slurm: the same SLURMRL_* variables are exported by the sbatch script (ports are derived
  from the job id by the plan); rank and world come from SLURM_PROCID / SLURM_NTASKS of the
  role's het group, and host lists from SLURM_JOB_NODELIST_HET_GROUP_K.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional


@dataclasses.dataclass(frozen=True, kw_only=True)
class Topology:
    role: str
    """orchestrator | inference | trainer | router."""
    rank: int
    """Rank inside the role (trainer: torch.distributed rank; inference: worker index)."""
    world_size: int
    """Processes of this role."""
    run_dir: str
    inference_urls: tuple[str, ...]
    """Base URLs of every inference worker, in worker-index order."""
    bind_host: str
    """Address this process's server binds to."""
    bind_port: Optional[int]
    """Port this process serves on (inference workers), else None."""
    master_addr: str
    """Trainer rendezvous host (torch.distributed TCP store)."""
    master_port: int
    """Trainer rendezvous port."""
    slurm_job_id: Optional[str] = None


def _need(env: Mapping[str, str], key: str) -> str:
    if key not in env:
        raise RuntimeError(f"environment variable {key} is not set: this process must be started by the slurmrl launcher "
                           f"or its sbatch script")
    return env[key]


def current_topology(env: Optional[Mapping[str, str]] = None) -> Topology:
    env = os.environ if env is None else env
    role = _need(env, "SLURMRL_ROLE")
    if "SLURM_PROCID" in env and "SLURMRL_LOCAL" not in env:
        rank, world = int(env["SLURM_PROCID"]), int(env.get("SLURM_NTASKS", "1"))
    else:
        rank, world = int(env.get("RANK", env.get("SLURMRL_RANK", "0"))), int(env.get("WORLD_SIZE", "1"))
    urls = tuple(u for u in env.get("SLURMRL_INFERENCE_URLS", "").split(",") if u)
    port = None
    if role == "inference":
        if not urls:
            raise RuntimeError("SLURMRL_INFERENCE_URLS is empty: an inference worker needs its own URL")
        if rank >= len(urls):
            raise RuntimeError(f"inference rank {rank} has no URL: SLURMRL_INFERENCE_URLS lists {len(urls)} workers")
        port = int(urls[rank].rsplit(":", 1)[1])
    return Topology(
        role=role,
        rank=rank,
        world_size=world,
        run_dir=_need(env, "SLURMRL_RUN_DIR"),
        inference_urls=urls,
        bind_host=env.get("SLURMRL_BIND_HOST", "127.0.0.1"),
        bind_port=port,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT", "29500")),
        slurm_job_id=env.get("SLURM_JOB_ID"),
    )
