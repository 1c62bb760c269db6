"""Task environments. ``make_env(cfg.env)`` picks one by name; unknown names list the choices."""
from __future__ import annotations

from workers.common.config import EnvConfig
from workers.orchestrator.envs.reverse_digits import ReverseDigitsEnv

ENVS = {"reverse_digits": ReverseDigitsEnv}


def make_env(cfg: EnvConfig, *, seed: int):
    if cfg.name not in ENVS:
        raise ValueError(f"env.name={cfg.name!r} is unknown; choose one of {sorted(ENVS)}")
    return ENVS[cfg.name](cfg, seed=seed)
