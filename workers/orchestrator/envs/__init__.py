"""Task environments: one module per env, each registering an ``EnvSpec`` in ``ENVS``.

``ENVS`` (workers/common/registry.py) maps ``env.name`` to the env's spec (envs/spec.py): its
config schema, its plan check, its tokenizer needs and ``make``. Every env speaks one protocol
(envs/base.py) that the episode runner (workers/orchestrator/episodes.py) drives: single-turn
envs (reverse_digits, reverse_text) are sessions whose first step ends the episode.

This package's ``__init__`` imports no env: looking a name up imports only that env's module.
"""
from __future__ import annotations

from typing import Any

from workers.common.registry import ENVS


def make_env(cfg: Any, *, seed: int, model: Any = None):
    """The env object of ``cfg`` (an env config); an unknown ``cfg.name`` lists the choices."""
    return ENVS.get(cfg.name).make(cfg, seed=seed, model=model)
