"""Entrypoint of an inference server task: ``python -m workers.inference``.

Started by the launcher (local process or srun step) with the SLURMRL_* environment; loads
the resolved run config and hands the task to the backend ``inference.backend`` names
(workers/inference/spec.py ``serve``): the embedded engine serves until SIGTERM, SGLang
replaces this process.
"""
import sys

from workers.common.config import load_run_config
from workers.common.exits import fatal_on_config_error
from workers.common.protocol import RunPaths
from workers.common.registry import BACKENDS
from workers.common.topology import current_topology


def main() -> int:
    topology = current_topology()
    cfg = load_run_config(str(RunPaths(topology.run_dir).run_config))
    return BACKENDS.get(cfg.inference.backend).serve(cfg, topology)


if __name__ == "__main__":
    sys.exit(fatal_on_config_error(main))
