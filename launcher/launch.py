"""Plan -> run directory -> backend. Shared by the CLI and by tests (no Hydra needed here)."""
from __future__ import annotations

from launcher.plan import build_plan
from launcher.run_dir import create_run_dir
from workers.common.config import RunConfig


def launch(cfg: RunConfig) -> int:
    plan = build_plan(cfg)  # every user mistake raises here, before anything is written
    paths = create_run_dir(cfg)
    procs = ", ".join(f"{r.num_procs} {r.role}" for r in plan.roles)
    print(f"[slurmrl] experiment {plan.experiment}: {procs}; model {plan.num_params / 1e6:.2f}M params; "
          f"{plan.samples_per_step} samples/step; run dir {paths.root}", flush=True)
    if cfg.launcher.dry_run:
        print(f"[slurmrl] dry run: resolved config in {paths.run_config}; nothing started", flush=True)
        return 0
    if plan.backend == "local":
        from launcher.local_backend import LocalBackend

        backend = LocalBackend(cfg, plan, paths)
        code = backend.run()
        print(f"[slurmrl] {'finished' if code == 0 else 'stopped'}: {backend.progress_summary}", flush=True)
        print(f"[slurmrl] run directory: {paths.root}", flush=True)
        return code
    raise NotImplementedError(f"cluster.backend={plan.backend!r}: the Slurm backend is not implemented yet")
