"""``python -m workers.trainer``: one trainer rank. The launcher sets the environment
(SLURMRL_ROLE=trainer, SLURMRL_RUN_DIR, RANK/WORLD_SIZE or SLURM_PROCID/SLURM_NTASKS,
MASTER_ADDR/MASTER_PORT); this loads the resolved run config and runs the loop."""
import logging
import os
import sys

from workers.common.config import load_run_config
from workers.common.exits import fatal_on_config_error
from workers.common.protocol import RunPaths
from workers.common.topology import current_topology
from workers.trainer.loop import train


def main() -> int:
    topology = current_topology()
    cfg = load_run_config(str(RunPaths(topology.run_dir).run_config))
    return train(topology, cfg)


def exit_now(code: int) -> None:
    """Flush, then leave without interpreter teardown: the process group is already destroyed
    (train's finally), and tearing down torch/gloo's C++ objects after a peer rank exited first
    aborted now and then ("terminate called without an active exception", exit -6 instead of
    the trainer's own code) on 2-rank gloo runs."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        code = fatal_on_config_error(main)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    exit_now(code)
