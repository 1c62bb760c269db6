"""env=target: a user's own environment class, named by import path (Hydra's ``_target_``),
without editing or registering anything in the project.

    slurmrl env=target env._target_=my_pkg.envs:CountDown +env.args.length=3
    slurmrl hydra.searchpath=[file:///home/me/conf] env=count_down   # conf/env/count_down.yaml:
        _target_: my_pkg.envs:CountDown      # (``name: target`` implied by ``_target_``)
        args: {length: 3}

The class speaks the env protocol (envs/base.py) by subclassing one of its base classes:
  * :class:`SingleTurnEnv`: writes ``sample_task`` (tasks with ``task_id`` and ``prompt_ids``) and
    ``score`` (optionally ``token_rewards``), sets ``max_new_tokens`` and ``stop_token_ids``;
  * :class:`MultiTurnEnv`: writes ``sample_task`` and ``session`` (reset/step/final_reward/close);
    its ``__init__(cfg, *, seed)`` gets this section, whose episode limits (``env.max_turns``, ...)
    the runner enforces.
It also says which tokens it speaks, as a class attribute ``vocab_size``: an int (its own ids
``0 .. vocab_size - 1``; the model must cover them) or None (the model's tokenizer, which only a
pretrained model has). ``eval_tasks(n)`` gives it an eval split (``orchestrator.eval_every_steps``).

How it is built (the orchestrator, ``make``): ``cls(**env.args, seed=...)``, plus ``cfg=<this
section>`` and ``model=<the model section>`` when its ``__init__`` takes them by those names.

Plan time (``check``, on the login node, before anything is written): the module is imported
(the user's code, with the user's rights, as a training script would be), the name must be such a
class with those methods written, ``vocab_size`` declared, and ``env.args`` must bind to its
``__init__``; each mistake is a ValueError naming the key. The orchestrator imports it again on
its own node, so the package must be on PYTHONPATH there too (the local backend passes the
launcher's environment on; on Slurm, the job's environment).
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Optional

from workers.common.config.ranges import Pattern, limits
from workers.common.import_path import import_object
from workers.common.registry import ENVS
from workers.orchestrator.envs.base import Env, MultiTurnEnv, MultiTurnEnvConfig, SingleTurnEnv, check_multi_turn
from workers.orchestrator.envs.spec import EnvSpec, check_latency, check_vocabulary
from workers.common.config.ranges import check_fields

EXAMPLE = "my_package.envs:MyEnv"
#: What a class of each base must write itself (the base's own method raises NotImplementedError).
REQUIRED = {SingleTurnEnv: ("sample_task", "score"), MultiTurnEnv: ("sample_task", "session")}


@dataclasses.dataclass(kw_only=True)
class TargetEnvConfig(MultiTurnEnvConfig):
    name: str = "target"
    """Task name (``target``: the class named by ``_target_``)."""
    _target_: str = ""
    """Import path of the env class: ``module.path:ClassName`` or ``module.path.ClassName`` (on PYTHONPATH)."""
    args: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments of the class's ``__init__`` (``+env.args.length=3``)."""


limits(TargetEnvConfig, _target_=Pattern(r"([A-Za-z_][\w.]*[:.][A-Za-z_][\w.]*)?", f"an import path like {EXAMPLE}"))


def env_class(cfg: TargetEnvConfig) -> type:
    """The class ``env._target_`` names, checked against the env protocol; ValueError naming the key."""
    if not cfg._target_:
        raise ValueError(f"env._target_ is required with env=target: the import path of your env class, "
                         f"e.g. env._target_={EXAMPLE}")
    cls = import_object(cfg._target_, key="env._target_", example=EXAMPLE)
    where = f"env._target_={cfg._target_!r}"
    if not inspect.isclass(cls):
        raise ValueError(f"{where} is a {type(cls).__name__}, not a class")
    base = next((b for b in REQUIRED if issubclass(cls, b)), None)
    if base is None:
        raise ValueError(f"{where}: {cls.__qualname__} must subclass SingleTurnEnv or MultiTurnEnv "
                         f"(workers.orchestrator.envs.base), the env protocol's base classes")
    missing = [m for m in REQUIRED[base] if getattr(cls, m) is getattr(base, m)]
    if missing:
        raise ValueError(f"{where}: {cls.__qualname__} ({base.__name__}) does not implement {missing}")
    if "vocab_size" not in dir(cls):
        raise ValueError(f"{where}: {cls.__qualname__} must declare the class attribute vocab_size: an int (its own "
                         f"token ids 0..vocab_size-1) or None (the model's tokenizer)")
    vocab = getattr(cls, "vocab_size")
    if vocab is not None and not (isinstance(vocab, int) and vocab > 0):
        raise ValueError(f"{where}: {cls.__qualname__}.vocab_size must be a positive int or None, got {vocab!r}")
    return cls


def init_kwargs(cls: type, cfg: TargetEnvConfig, *, seed: int, model: Any) -> dict[str, Any]:
    """``env.args`` + seed (+ cfg, model where ``__init__`` takes them); ValueError when they do not bind."""
    params = inspect.signature(cls).parameters
    kwargs = {**dict(cfg.args), "seed": seed}
    kwargs.update({k: v for k, v in (("cfg", cfg), ("model", model)) if k in params and k not in cfg.args})
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        raise ValueError(f"env.args={dict(cfg.args)}: {cls.__qualname__}{inspect.signature(cls)} cannot be built as "
                         f"{cls.__name__}(**env.args, seed=...): {e}") from None
    return kwargs


def check(run_cfg: Any) -> None:
    """Fields and latency, then the class: protocol, episode limits (multi-turn), vocabulary, arguments,
    eval split."""
    e = run_cfg.env
    check_fields(e, "env")
    check_latency(e)
    cls = env_class(e)
    if issubclass(cls, MultiTurnEnv):  # a single-turn env's limits come from its max_new_tokens
        check_multi_turn(run_cfg)
    check_vocabulary(dataclasses.replace(SPEC, name=f"target ({cls.__qualname__})",
                                         vocab_size=None if cls.vocab_size is None else lambda _: cls.vocab_size),
                     run_cfg)
    init_kwargs(cls, e, seed=run_cfg.seed, model=run_cfg.model)
    if run_cfg.orchestrator.eval_every_steps > 0 and getattr(cls, "eval_tasks", None) is None:
        raise ValueError(f"orchestrator.eval_every_steps({run_cfg.orchestrator.eval_every_steps}) > 0 but "
                         f"{cls.__qualname__} (env._target_) has no eval split: write eval_tasks(n)")


def make(cfg: TargetEnvConfig, *, seed: int, model: Optional[Any] = None) -> Env:
    cls = env_class(cfg)
    return cls(**init_kwargs(cls, cfg, seed=seed, model=model))


SPEC = ENVS.register(EnvSpec(
    name="target", config=TargetEnvConfig, check=check, make=make, eval_split=True,
    summary="your own env class by import path: env=target env._target_=my_pkg.envs:MyEnv +env.args.k=v"))
