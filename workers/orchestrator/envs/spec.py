"""EnvSpec: what an environment registers in ``ENVS`` (workers/common/registry.py), and the
plan-time checks every env shares.

One module per env (envs/reverse_digits.py, ...) owns, in this order: its config dataclass
(a subclass of ``EnvConfig``; the schema of the Hydra option ``env=<name>``), its pure plan
check, its tokenizer needs, its role code (the env class) and, last, ``ENVS.register(EnvSpec(...))``.
The launcher reaches an env only through ``ENVS.get(cfg.env.name).check(cfg)``; the orchestrator
only through ``ENVS.get(cfg.env.name).make(cfg.env, seed=..., model=cfg.model)``.

Tokenizer needs (``vocab_size``): an env either brings its own small vocabulary (digit or
byte tokens, ids ``0 .. vocab_size(env_cfg) - 1``, so ``model.vocab_size`` must be at least
that) or, with ``vocab_size=None``, tokenizes with the model's own tokenizer, which only a
pretrained model has (``model.pretrained`` must be set).

This module is torch-free and imports no role code: the launcher imports it on the login node.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from workers.common.config.ranges import check_fields, positive
from workers.common.registry import PluginSpec

LATENCIES = ("none", "lognormal", "pareto")


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False, repr=False)  # check may refer back to self
class EnvSpec(PluginSpec):
    """An environment: ``name`` (= ``env.name``), ``config`` (its schema), ``make`` and its needs.

    ``check`` (what the launcher calls) runs the shared checks (latency fields, vocabulary /
    tokenizer) and then ``env_check``; leave ``check`` unset unless you replace all of them.
    """

    make: Callable[..., Any]
    """``make(env_cfg, *, seed, model) -> Env``: the orchestrator's env object (envs/base.py
    protocol). ``model`` is the run's model config (for envs using the model's tokenizer).
    Import heavy role code inside it, not at module level."""
    vocab_size: Optional[Callable[[Any], int]] = None
    """``vocab_size(env_cfg) -> int``: token ids the env's own tokenizer uses; None: the env
    uses the model's tokenizer (needs ``model.pretrained``)."""
    env_check: Optional[Callable[[Any], None]] = None
    """The env's own plan-time check ``env_check(run_cfg)``: pure, raises ValueError naming the key."""
    eval_split: bool = False
    """The env has an eval split: its object has ``eval_tasks(n)`` (the orchestrator's
    ``eval_every_steps``); the plan refuses evaluation of an env without one."""
    host_check: Optional[Callable[[Any], None]] = None
    """``host_check(run_cfg)``: what only the machine the orchestrator runs on can answer (e.g. which
    sandbox modes work). The launcher calls it before writing anything when the roles run on its own
    machine (cluster.backend=local); on Slurm the env checks the same when it starts. Raises
    ValueError naming the key."""

    def __post_init__(self) -> None:
        if self.check is None:
            object.__setattr__(self, "check", self.plan_check)

    def __repr__(self) -> str:
        return f"EnvSpec(name={self.name!r}, config={self.config.__qualname__}, module={self.config.__module__})"

    def plan_check(self, run_cfg: Any) -> None:
        """Everything the plan checks for this env: every field in its range (rules beside its schema),
        latency, vocabulary, then ``env_check``."""
        check_fields(run_cfg.env, "env")
        check_latency(run_cfg.env)
        check_vocabulary(self, run_cfg)
        if self.env_check is not None:
            self.env_check(run_cfg)


def check_latency(e: Any) -> None:
    """The simulated env-step latency (envs/latency.py), a field of every env."""
    if e.latency not in LATENCIES:
        raise ValueError(f"env.latency={e.latency!r} is not supported; choose one of {list(LATENCIES)}")
    if e.latency != "none":
        positive("env.latency_median_s", e.latency_median_s)
        if e.latency_p99_over_median < 1:
            raise ValueError(f"env.latency_p99_over_median({e.latency_p99_over_median}) must be >= 1 (p99 >= median)")


def check_vocabulary(spec: EnvSpec, run_cfg: Any) -> None:
    """The model can emit every token of the env's vocabulary, or has the tokenizer the env uses."""
    m = run_cfg.model
    if spec.vocab_size is None:
        from workers.models.pretrained import tokenizer_dir

        if tokenizer_dir(m) is None:
            raise ValueError(f"env={spec.name} uses a pretrained model's tokenizer and chat template, but model "
                             f"{m.name} has none (model.pretrained is empty and model.path has no tokenizer); use "
                             f"a pretrained model such as model=smollm2_135m or a model.path with tokenizer files")
        return
    need = spec.vocab_size(run_cfg.env)
    if need > m.vocab_size:
        raise ValueError(f"model.vocab_size({m.vocab_size}) is smaller than env {spec.name}'s vocabulary ({need})")
