"""``python -m workers.orchestrator``: load the run config, run the rollout loop."""
from workers.common.config import load_run_config
from workers.common.exits import fatal_on_config_error
from workers.common.protocol import RunPaths
from workers.common.topology import current_topology
from workers.orchestrator.loop import run_orchestrator


def main() -> None:
    topo = current_topology()
    run_orchestrator(load_run_config(str(RunPaths(topo.run_dir).run_config)), topo)


if __name__ == "__main__":
    fatal_on_config_error(main)
