"""Entrypoint of an embedded inference worker: ``python -m workers.inference``.

Started by the launcher (local process or srun step) with the SLURMRL_* environment;
reads the resolved run config and serves SGLang's native HTTP API until SIGTERM.
"""
import sys

import torch

from workers.common.config import load_run_config
from workers.common.protocol import RunPaths
from workers.common.topology import current_topology
from workers.inference.server import run_server

if __name__ == "__main__":
    topology = current_topology()
    cfg = load_run_config(str(RunPaths(topology.run_dir).run_config))
    torch.set_num_threads(cfg.inference.num_threads)
    sys.exit(run_server(cfg, topology))
