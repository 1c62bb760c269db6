"""Task environments. ``make_env(cfg.env)`` picks one by name; unknown names list the choices.

Single-turn envs (reverse_digits) expose ``sample_task``/``score``; multi-turn envs derive
from envs.base.MultiTurnEnv and run through workers/orchestrator/episodes.py.
"""
from __future__ import annotations

from workers.common.config import EnvConfig
from workers.orchestrator.envs.code_repair import CodeRepairEnv
from workers.orchestrator.envs.reverse_digits import ReverseDigitsEnv
from workers.orchestrator.envs.verifiers_adapter import VerifiersEnv

ENVS = {"reverse_digits": ReverseDigitsEnv, "code_repair": CodeRepairEnv, "verifiers": VerifiersEnv}


def make_env(cfg: EnvConfig, *, seed: int):
    if cfg.name not in ENVS:
        raise ValueError(f"env.name={cfg.name!r} is unknown; choose one of {sorted(ENVS)}")
    return ENVS[cfg.name](cfg, seed=seed)
