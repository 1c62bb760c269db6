"""Env section: the task environment (``env/`` Hydra group), fields every env has.

Each env's own fields live in its own config dataclass, a subclass of :class:`EnvConfig` in its
module under workers/orchestrator/envs/ (registered in ``ENVS``, so it is the schema of the
option ``env=<name>``); multi-turn envs extend ``MultiTurnEnvConfig`` (envs/base.py). A field
the chosen env does not have is refused with its name.
"""
from __future__ import annotations

import dataclasses

from omegaconf import MISSING

from workers.common.config.ranges import NONEMPTY, SEED, ge, limits, one_of


@dataclasses.dataclass(kw_only=True)
class EnvConfig:
    name: str = MISSING
    """Task name (``reverse_digits``): picks the env and its schema."""
    seed: int = 0
    """Seed of the prompt stream."""
    latency: str = "none"
    """Simulated env-step latency per episode (a sandbox/tool run): none | lognormal | pareto."""
    latency_median_s: float = 0.0
    """Median of the simulated latency in seconds."""
    latency_p99_over_median: float = 20.0
    """Tail heaviness: p99 / median of the simulated latency (>= 1)."""


limits(EnvConfig, name=NONEMPTY, seed=SEED, latency=one_of("none", "lognormal", "pareto"), latency_median_s=ge(0),
       latency_p99_over_median=ge(1))
