"""Entrypoint of an inference worker: ``python -m workers.inference`` (embedded engine or SGLang).

Started by the launcher (local process or srun step) with the SLURMRL_* environment;
reads the resolved run config and serves SGLang's native HTTP API until SIGTERM.
"""
import sys

import torch

from workers.common.config import load_run_config
from workers.common.protocol import RunPaths, read_admin_token
from workers.common.topology import current_topology
from workers.inference.server import run_server

if __name__ == "__main__":
    topology = current_topology()
    paths = RunPaths(topology.run_dir)
    cfg = load_run_config(str(paths.run_config))
    if cfg.inference.backend == "sglang":  # GPU clusters: become the SGLang server (workers/inference/sglang.py)
        from workers.inference.sglang import exec_server
        exec_server(cfg, topology, api_key=read_admin_token(paths))
    torch.set_num_threads(cfg.inference.num_threads)
    sys.exit(run_server(cfg, topology))
