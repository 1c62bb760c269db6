"""Task environments. ``make_env(cfg.env)`` picks one by name; unknown names list the choices.

Single-turn envs (reverse_digits) expose ``sample_task``/``score``; multi-turn envs derive
from envs.base.MultiTurnEnv and run through workers/orchestrator/episodes.py.
"""
from __future__ import annotations

from workers.common.config import EnvConfig
from workers.orchestrator.envs.code_repair import CodeRepairEnv
from workers.orchestrator.envs.reverse_digits import ReverseDigitsEnv
from workers.orchestrator.envs.reverse_text import ReverseTextEnv
from workers.orchestrator.envs.verifiers_adapter import VerifiersEnv

ENVS = {"reverse_digits": ReverseDigitsEnv, "code_repair": CodeRepairEnv, "verifiers": VerifiersEnv,
        "reverse_text": ReverseTextEnv}
#: Envs that tokenize with the model's own tokenizer (a pretrained model): they get ``model``.
MODEL_TOKENIZER_ENVS = ("reverse_text",)


def make_env(cfg: EnvConfig, *, seed: int, model=None):
    if cfg.name not in ENVS:
        raise ValueError(f"env.name={cfg.name!r} is unknown; choose one of {sorted(ENVS)}")
    if cfg.name in MODEL_TOKENIZER_ENVS:
        return ENVS[cfg.name](cfg, seed=seed, model=model)
    return ENVS[cfg.name](cfg, seed=seed)
