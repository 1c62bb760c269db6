"""The config as the CLI composes it, plans and plan errors (every test tier uses these)."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import OmegaConf

from launcher.config_store import register
from launcher.plan import JobPlan, PlanError, build_plan
from workers.common.config import RunConfig

REPO = Path(__file__).resolve().parents[2]
register()  # the run schema and every registered entry's schema in Hydra's ConfigStore

CONF_DIR = str(REPO / "hydra_conf")


TINY_SLURM = ["cluster=local_slurm"]


GLM5 = ["experiment=glm5_swe_28xh200", "cluster=h200_ib"]


def compose(overrides: list[str]) -> RunConfig:
    """The resolved RunConfig for these overrides, as the CLI composes it, planned as a dry run
    (``launcher.dry_run=true`` unless the overrides say otherwise: the GLM-5, Kimi K2 and Nemotron
    presets name families that only plan, refused when a run would start)."""
    if not any(o.startswith("launcher.dry_run=") for o in overrides):
        overrides = ["launcher.dry_run=true", *overrides]
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return OmegaConf.to_object(hydra_compose("config", overrides=overrides))


def plan(overrides: list[str]) -> JobPlan:
    return build_plan(compose(overrides))


def plan_error(overrides: list[str]) -> str:
    with pytest.raises(PlanError) as e:
        plan(overrides)
    return str(e.value)
