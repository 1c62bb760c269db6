"""Heavy-tailed env latency: what makes agentic RL asynchronous in the first place.

Real agentic episodes wait on tools (test suites, builds, web calls) whose durations
are heavy-tailed: most take seconds, a few take minutes. This module draws such a wait
per episode from a lognormal or Pareto law given by its median and its p99/median ratio,
so benchmarks (benchmarks/async_vs_sync.py) can show what the async loop buys. The wait
is an ``asyncio.sleep``: it occupies no CPU, exactly like waiting on a remote sandbox.

    lognormal: sigma = ln(p99/median) / z_0.99,       median = exp(mu)
    pareto:    alpha = ln(50) / ln(p99/median),        median = x_m * 2^(1/alpha)
"""
from __future__ import annotations

import asyncio
import math
import random

from workers.common.config import EnvConfig

Z99 = 2.3263478740408408  # standard normal 0.99 quantile


class LatencyModel:
    def __init__(self, cfg: EnvConfig, *, seed: int):
        if cfg.latency not in ("none", "lognormal", "pareto"):
            raise ValueError(f"env.latency={cfg.latency!r}: choose none | lognormal | pareto")
        if cfg.latency != "none" and (cfg.latency_median_s <= 0 or cfg.latency_p99_over_median < 1):
            raise ValueError(f"env.latency_median_s({cfg.latency_median_s}) must be > 0 and "
                             f"env.latency_p99_over_median({cfg.latency_p99_over_median}) >= 1")
        self.kind, self.median, self.ratio = cfg.latency, cfg.latency_median_s, cfg.latency_p99_over_median
        self.rng = random.Random(seed * 7919 + 17)

    def sample(self) -> float:
        if self.kind == "none":
            return 0.0
        if self.kind == "lognormal":
            sigma = math.log(self.ratio) / Z99
            return self.rng.lognormvariate(math.log(self.median), sigma)
        alpha = math.log(50.0) / math.log(self.ratio) if self.ratio > 1 else 1e9
        x_m = self.median / 2 ** (1 / alpha)
        return x_m * self.rng.paretovariate(alpha)

    async def wait(self) -> float:
        """Sleep one sampled latency; returns the seconds waited (for env-time metrics)."""
        s = self.sample()
        if s > 0:
            await asyncio.sleep(s)
        return s
