"""``slurmrl`` console script: compose the Hydra config, plan, write the run dir, launch.

    slurmrl                                   # experiment=tiny_local on this machine
    slurmrl trainer.lr=3e-4 orchestrator.max_off_policy_steps=0
    slurmrl launcher.dry_run=true             # write configs, print what would start
"""
from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from launcher.config_store import register
from launcher.launch import launch
from launcher.plan import PlanError
from launcher.run_dir import RunDirError

register()


@hydra.main(version_base=None, config_path="../hydra_conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        run_cfg = OmegaConf.to_object(cfg)
        code = launch(run_cfg)
    except (PlanError, RunDirError, OmegaConfBaseException) as e:
        print(f"slurmrl: error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(code)


if __name__ == "__main__":
    main()
