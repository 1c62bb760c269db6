"""Rollout shapes: how many turns, how many tokens each way, how long the environment takes.

Why its own module: the workload, not the hardware, is what makes RL asynchronous (a long
tail of slow episodes), so it is drawn from explicit distributions that the sensitivity
study can move. Two workloads:

  EnvWorkload  the env the config names (reverse_digits: one turn of a few tokens, plus the
               env's own heavy-tailed latency when ``env.latency`` is set)
  SweWorkload  multi-turn SWE agent episodes at up to ``max_context`` tokens (assumptions.py)

A rollout is a list of *segments* (prefill new tokens -> KV transfer -> decode -> env wait).
Long episodes merge consecutive turns into at most ``max_segments`` segments: token and
latency totals are drawn per turn and summed, so throughput and per-rollout latency are
unchanged while the event count drops ~5x (tests/unit/simulator/test_sim_engine.py checks the match).
Heavy tails use the same parametrisation as workers/orchestrator/envs: a median and p99/median.
"""
from __future__ import annotations

import dataclasses
import math
import random

import numpy as np

from tools.simulator.assumptions import SweWorkload as SweFacts

Z99 = 2.3263478740408408  # standard normal 0.99 quantile
TOOL_TIMEOUT_S = 180.0  # assumption: agent scaffolds kill a tool call after a few minutes


def heavy_tail(rng: random.Random, law: str, median: float, p99_over_median: float) -> float:
    """One draw from a lognormal or Pareto law with the given median and p99/median."""
    if median <= 0:
        return 0.0
    if law == "lognormal" or p99_over_median <= 1:
        sigma = math.log(max(p99_over_median, 1.0)) / Z99
        return rng.lognormvariate(math.log(median), sigma)
    if law == "pareto":
        alpha = math.log(50.0) / math.log(p99_over_median)
        return median / 2 ** (1 / alpha) * rng.paretovariate(alpha)
    raise ValueError(f"latency law {law!r}: choose lognormal | pareto")


def draws(g: np.random.Generator, law: str, median: float, p99_over_median: float, size: int) -> np.ndarray:
    """Vectorised :func:`heavy_tail` (numpy's pareto is Lomax: classical Pareto = x_m * (1 + X))."""
    if law == "lognormal" or p99_over_median <= 1:
        return median * np.exp(g.standard_normal(size) * (math.log(max(p99_over_median, 1.0)) / Z99))
    alpha = math.log(50.0) / math.log(p99_over_median)
    return median / 2 ** (1 / alpha) * (1.0 + g.pareto(alpha, size))


@dataclasses.dataclass
class Segment:
    prefill_tokens: int
    """New tokens to prefill (this turn's tool output and the previous turn's decoded tokens)."""
    transfer_tokens: int
    """Sum over the merged turns of the context whose KV goes prefill -> decode."""
    decode_tokens: int
    env_s: float
    """Environment wait after the decode (tool call, or the final reward)."""
    ctx_start: int = 0
    """Context before this segment's prefill: the prefix a prefill replica may hold cached."""
    turns: tuple = ()
    """(context before, context after) each merged turn's prefill: a prefix-cache miss costs a
    full recompute on every turn, not once per segment, so the system prices turns one by one."""


@dataclasses.dataclass
class RolloutShape:
    start_s: float
    segments: list[Segment]
    total_tokens: int
    """Prompt + everything appended: the sequence the trainer trains on."""
    completion_tokens: int
    """Tokens the policy generated (the loss tokens)."""


class EnvWorkload:
    """Single-turn episodes of the configured env (reverse_digits)."""

    def __init__(self, env_cfg, *, completion_mean: float | None = None):
        self.cfg = env_cfg
        lo, hi = env_cfg.min_digits, env_cfg.max_digits
        self.completion_mean = completion_mean if completion_mean is not None else (lo + hi) / 2 + 1
        self.law = getattr(env_cfg, "latency", "none")
        self.median = getattr(env_cfg, "latency_median_s", 0.0)
        self.ratio = getattr(env_cfg, "latency_p99_over_median", 20.0)

    def group(self, rng: random.Random, size: int) -> list[RolloutShape]:
        n = rng.randint(self.cfg.min_digits, self.cfg.max_digits)
        prompt = n + 2  # BOS digits SEP
        out = []
        for _ in range(size):
            mean, top = self.completion_mean, self.cfg.max_digits + 1
            comp = min(top, max(1, int(mean) + (rng.random() < mean - int(mean))))
            env = heavy_tail(rng, self.law, self.median, self.ratio) if self.law != "none" else 0.0
            out.append(RolloutShape(start_s=0.0, segments=[Segment(prompt, 0, comp, env, turns=((0, prompt),))],
                                    total_tokens=prompt + comp, completion_tokens=comp))
        return out


class SweWorkload:
    """Multi-turn SWE episodes; all samples of a group share the issue (the prompt)."""

    def __init__(self, facts: SweFacts, *, max_segments: int = 8):
        self.f, self.max_segments = facts, max_segments

    def _turns(self, g: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(decode tokens, tool-output tokens, env seconds) per turn, cut where the context fills."""
        f = self.f
        num = int(min(f.max_turns, max(1, round(float(draws(g, "lognormal", f.turns_median, f.turns_p99_over_median, 1)[0])))))
        d = np.maximum(1, np.rint(draws(g, "lognormal", f.decode_tokens_median, f.decode_tokens_p99_over_median, num)))
        t = np.rint(draws(g, "lognormal", f.tool_tokens_median, f.tool_tokens_p99_over_median, num))
        t[-1] = 0
        env = np.minimum(TOOL_TIMEOUT_S, draws(g, f.tool_latency_law, f.tool_latency_median_s,
                                                f.tool_latency_p99_over_median, num))
        after = f.prompt_tokens + np.cumsum(d + t)  # context after each turn
        full = np.nonzero(after >= f.max_context)[0]
        if len(full):  # the context fills during turn k: it decodes what still fits and ends
            k = int(full[0])
            before = f.prompt_tokens + (after[k - 1] - f.prompt_tokens if k else 0)
            d, t, env = d[:k + 1], t[:k + 1], env[:k + 1]
            d[k] = max(0, min(d[k], f.max_context - before))
            t[k] = 0
        env[-1] = draws(g, "lognormal", f.reward_latency_median_s, f.reward_latency_p99_over_median, 1)[0]
        return d, t, env

    def rollout(self, g: np.random.Generator) -> RolloutShape:
        f = self.f
        d, t, env = self._turns(g)
        n = len(d)
        after = f.prompt_tokens + np.cumsum(d + t)
        before = np.concatenate(([f.prompt_tokens], after[:-1]))  # context when each turn's prefill ends
        pending = np.concatenate(([f.prompt_tokens], (d + t)[:-1]))  # what each turn prefills
        per = math.ceil(n / self.max_segments)
        idx = np.arange(0, n, per)
        sums = [np.add.reduceat(x, idx) for x in (pending, before, d, env)]
        spans = list(zip((before - pending).tolist(), before.tolist()))
        segments = [Segment(int(p), int(b), int(dd), float(e), ctx_start=int(before[k] - pending[k]),
                            turns=tuple(spans[k:k + per])) for k, p, b, dd, e in zip(idx, *sums)]
        start = float(draws(g, "lognormal", f.start_latency_median_s, 3.0, 1)[0])
        return RolloutShape(start_s=start, segments=segments, total_tokens=int(after[-1]), completion_tokens=int(d.sum()))

    def group(self, rng: random.Random, size: int) -> list[RolloutShape]:
        g = np.random.default_rng(rng.getrandbits(63))
        return [self.rollout(g) for _ in range(size)]


def describe(workload, rng: random.Random, n: int = 2000) -> dict[str, float]:
    """Sample statistics for the report (tokens, turns-equivalents, env seconds per rollout)."""
    shapes = [s for _ in range(max(1, n // 8)) for s in workload.group(rng, 8)]
    tot = sorted(s.total_tokens for s in shapes)
    env = sorted(s.start_s + sum(g.env_s for g in s.segments) for s in shapes)
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"tokens_mean": sum(tot) / len(tot), "tokens_p50": pct(tot, 0.5), "tokens_p99": pct(tot, 0.99),
            "completion_mean": sum(s.completion_tokens for s in shapes) / len(shapes),
            "env_s_mean": sum(env) / len(env), "env_s_p99": pct(env, 0.99),
            "frac_at_max_context": sum(t >= getattr(getattr(workload, "f", None), "max_context", 1 << 60) - 1
                                       for t in tot) / len(tot)}
