"""``python -m workers.trainer``: one trainer rank. The launcher sets the environment
(SLURMRL_ROLE=trainer, SLURMRL_RUN_DIR, RANK/WORLD_SIZE or SLURM_PROCID/SLURM_NTASKS,
MASTER_ADDR/MASTER_PORT); this loads the resolved run config and runs the loop."""
import sys

from workers.common.config import load_run_config
from workers.common.protocol import RunPaths
from workers.common.topology import current_topology
from workers.trainer.loop import train


def main() -> int:
    topology = current_topology()
    cfg = load_run_config(str(RunPaths(topology.run_dir).run_config))
    return train(topology, cfg)


if __name__ == "__main__":
    sys.exit(main())
