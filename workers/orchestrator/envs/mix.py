"""env=mix: several environments in one run, each prompt group drawn from one of them by weight.

    env:
      name: mix
      weights: {digits: 0.7, arith: 0.3}
      envs:
        digits: {name: reverse_digits, min_digits: 2, max_digits: 4}
        arith: {name: dataset, path: /data/arith.jsonl, prompt_key: question}

Each entry of ``envs`` is a whole env section (its ``name`` picks its schema, as ``env.name``
does), checked by that env's own plan check; ``weights`` has one positive weight per entry
(normalised). A group is one env's task: the loop asks :meth:`MixEnv.resolve` for the env that
runs it, so episodes use that env's limits, stop tokens and scoring unchanged. Its groups are
tagged with the entry's label, so every batch reports ``env/<label>/...`` (reward_mean, turns,
finish reasons, ...) per env; evaluation covers the entries with an eval split and reports
``eval/<label>/reward`` beside the overall ``eval/reward``.

All entries share the model, so they must share its token space: entries with their own small
vocabularies (reverse_digits) need ``model.vocab_size`` to cover each, entries using the model's
tokenizer need a pretrained model — each entry's own check says so, named ``env.envs.<label>``.
The draw is seeded (``seed``, ``env.seed``) and each entry's task stream is its own, so a
restarted orchestrator replays the same sequence (task ids ``<label>:<entry's task id>``).
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any

from omegaconf import OmegaConf

from workers.common.config import EnvConfig
from workers.common.config.ranges import Each, check_fields, gt, limits
from workers.common.registry import ENVS
from workers.orchestrator.envs.base import Env
from workers.orchestrator.envs.spec import EnvSpec, check_latency


@dataclasses.dataclass(kw_only=True)
class MixConfig(EnvConfig):
    name: str = "mix"
    """Task name."""
    weights: dict[str, float] = dataclasses.field(default_factory=dict)
    """Label -> sampling weight (> 0) of each entry of ``envs``; normalised."""
    envs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Label -> an env section (``{name: reverse_digits, ...}``), each on its own env's schema."""


limits(MixConfig, weights=Each(gt(0)))


def entries(e: MixConfig) -> dict[str, Any]:
    """Label -> the entry's env config (a dataclass of its own schema); ValueError naming the key."""
    from workers.common.config import structure_section

    if not e.envs:
        raise ValueError("env=mix needs env.envs: label -> an env section ({name: reverse_digits, ...})")
    if set(e.weights) != set(e.envs):
        raise ValueError(f"env.weights labels {sorted(e.weights)} must be env.envs labels {sorted(e.envs)}")
    out = {}
    for label, node in e.envs.items():
        node = OmegaConf.to_container(node) if OmegaConf.is_config(node) else node
        if not isinstance(node, dict):
            raise ValueError(f"env.envs.{label} must be an env section ({{name: <env>, ...}}), got {node!r}")
        if node.get("name") == "mix":
            raise ValueError(f"env.envs.{label}: an env=mix cannot hold another mix")
        try:
            out[label] = OmegaConf.to_object(structure_section("env", node))
        except ValueError as err:
            raise ValueError(f"env.envs.{label}: {err}") from None
    return out


def check(run_cfg: Any) -> None:
    """The mix's own fields, then every entry through its own env's plan check (errors named
    ``env.envs.<label>``); evaluation needs at least one entry with an eval split."""
    e = run_cfg.env
    check_fields(e, "env")
    check_latency(e)
    subs = entries(e)
    o = run_cfg.orchestrator
    quiet = dataclasses.replace(o, eval_every_steps=0)  # the mix decides about evaluation, below
    for label, sub in subs.items():
        try:
            ENVS.get(sub.name).check(dataclasses.replace(run_cfg, env=sub, orchestrator=quiet))
        except ValueError as err:
            raise ValueError(f"env.envs.{label}: {err}") from None
    if o.eval_every_steps > 0 and not any(ENVS.get(s.name).eval_split for s in subs.values()):
        raise ValueError("orchestrator.eval_every_steps > 0 but no entry of env.envs has an eval split "
                         "(env=dataset with env.eval_path or env.eval_fraction)")


@dataclasses.dataclass(frozen=True)
class MixTask:
    task_id: str
    """``<label>:<the entry's task id>``: what the ledger records."""
    label: str
    inner: Any


class MixEnv(Env):
    """Draws each task from one entry by weight; :meth:`resolve` hands the loop that entry's env."""

    name = "mix"

    def __init__(self, cfg: MixConfig, *, seed: int, model=None):
        from workers.orchestrator.envs import make_env

        subs = entries(cfg)
        self.labels = sorted(subs)
        self.weights = [cfg.weights[label] for label in self.labels]
        self.envs = {label: make_env(subs[label], seed=seed, model=model) for label in self.labels}
        self.rng = random.Random(f"env-mix:{seed}:{cfg.seed}")
        self.drawn = {label: 0 for label in self.labels}
        self.stop_token_ids = ()

    def sample_task(self) -> MixTask:
        label = self.rng.choices(self.labels, weights=self.weights)[0]
        self.drawn[label] += 1
        inner = self.envs[label].sample_task()
        return MixTask(f"{label}:{inner.task_id}", label, inner)

    def resolve(self, task: MixTask) -> tuple[Env, Any]:
        return self.envs[task.label], task.inner

    def eval_tasks(self, n: int) -> list[MixTask]:
        """The first ``n`` eval records of every entry with an eval split."""
        return [MixTask(f"{label}:{t.task_id}", label, t) for label in self.labels
                if hasattr(self.envs[label], "eval_tasks") for t in self.envs[label].eval_tasks(n)]

    def text(self, ids) -> str:
        """Decoded by the first entry with a tokenizer (entries share the model's, or use their own ids)."""
        for label in self.labels:
            env = self.envs[label]
            if type(env).text is not Env.text:
                return env.text(ids)
        return super().text(ids)

    def state(self) -> dict:
        return {"drawn": dict(self.drawn), **{label: self.envs[label].state() for label in self.labels}}

    def metrics(self) -> dict:
        out = {f"env/{label}/tasks_drawn_total": n for label, n in self.drawn.items()}
        for label in self.labels:
            out.update({f"env/{label}/{k}": v for k, v in self.envs[label].metrics().items()})
        return out

    @property
    def limits(self):  # the loop asks the entry's env (resolve); a direct use is a bug
        raise AttributeError("env=mix has no limits of its own: run episodes on MixEnv.resolve(task)'s env")


ENVS.register(EnvSpec(name="mix", config=MixConfig, check=check, eval_split=True,
                      make=lambda cfg, *, seed, model=None: MixEnv(cfg, seed=seed, model=model),
                      summary="several envs in one run, each group drawn from one of them by weight"))
