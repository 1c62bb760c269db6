"""Entrypoint of the router role: ``python -m workers.router`` (one task, control component).

Loads the resolved run config and the Topology, then hands the task to the inference backend
(``serve_router`` of its spec; SGLang's replaces this process by smg, so Slurm's SIGTERM
reaches the router directly). The plan starts this role only for backends that need a router.
"""
import sys

from workers.common.config import load_run_config
from workers.common.protocol import RunPaths
from workers.common.registry import BACKENDS
from workers.common.topology import current_topology

if __name__ == "__main__":
    topology = current_topology()
    cfg = load_run_config(str(RunPaths(topology.run_dir).run_config))
    backend = BACKENDS.get(cfg.inference.backend)
    if backend.serve_router is None:
        sys.exit(f"router: inference.backend={backend.name} has no router (the plan starts none for it)")
    sys.exit(backend.serve_router(cfg, topology))
