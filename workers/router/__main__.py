"""Entrypoint of the router role: ``python -m workers.router`` (one task, control component).

Loads the resolved run config and the Topology, then replaces itself by smg with the argv
of workers/router/argv.py (exec: Slurm's SIGTERM reaches the router directly).
"""
import sys

from workers.common.config import load_run_config
from workers.common.protocol import RunPaths, read_admin_token
from workers.common.topology import current_topology
from workers.router.argv import exec_router

if __name__ == "__main__":
    topology = current_topology()
    paths = RunPaths(topology.run_dir)
    cfg = load_run_config(str(paths.run_config))
    sys.exit(exec_router(cfg, topology, api_key=read_admin_token(paths)))
