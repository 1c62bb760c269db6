"""Algorithm section: which RL recipe a run follows (``algorithm=`` Hydra group, hydra_conf/algorithm/).

A recipe is a preset of documented ``trainer.*`` / ``orchestrator.*`` keys (advantage
normalisation, loss aggregation, clipping, dynamic sampling, overlong shaping; see
docs/guide/algorithms.md), so every one of its settings can be changed on the command line;
``algorithm.name`` only records which preset the run started from, and the plan prints the
effective settings in one line (:func:`describe`). Also here: the plan-time checks of the
recipe knobs that span sections (:func:`check_algorithm`), torch-free like every config module.
"""
from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

from workers.common.config.ranges import TEXT, between, limits, one_of

ALGORITHMS = ("grpo", "dapo", "dr_grpo", "gspo", "cispo", "on_policy_distill")
"""``algorithm.name`` choices: the files of hydra_conf/algorithm/."""
PRETRAINED_LR_MAX = 1e-4
"""Above this ``trainer.lr`` on a user's checkpoint (``model.path``) the plan warns."""


@dataclasses.dataclass(kw_only=True)
class TeacherConfig:
    path: str = ""
    """On-policy distillation: the teacher's Hugging Face checkpoint directory (any family and size, the
    student's tokenizer: the launcher refuses another). Scored locally by an embedded engine in the orchestrator."""
    reward_weight: float = 0.0
    """Mix of the task reward into the distillation signal: each token's advantage is the teacher's minus
    the student's log-prob (the negative per-token reverse KL) plus this times the sample's task advantage."""


@dataclasses.dataclass(kw_only=True)
class AlgorithmConfig:
    name: str = "grpo"
    """The recipe preset the run started from (``algorithm=<name>``); the knobs themselves are trainer.* / orchestrator.*."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """The teacher of ``algorithm=on_policy_distill``."""


limits(AlgorithmConfig, name=one_of(*ALGORITHMS))
limits(TeacherConfig, path=TEXT, reward_weight=between(0, 100))


def _clip(low: float, high: float) -> str:
    return "off" if not (low or high) else f"[1-{low:g}, 1+{high:g}]".replace("1-0,", "none,").replace("1+0]", "none]")


def describe(cfg: Any) -> str:
    """One line: the recipe and the effective value of every knob it sets (the plan prints it)."""
    t, o, a = cfg.trainer, cfg.orchestrator, cfg.algorithm
    parts = [
        f"advantage={o.advantage}/{o.advantage_norm}",
        f"loss_agg={t.loss_agg}",
        f"ratio_level={t.ratio_level}",
        f"clip={_clip(t.clip_low, t.clip_high)}",
        f"is_cap={t.ratio_cap:g}",
        f"is_mask=[{t.ratio_mask_low:g}, {t.ratio_mask_high:g}]",
        f"dynamic_sampling={'on' if o.dynamic_sampling else 'off'}",
        f"overlong=last {o.overlong_buffer_frac:g} of L, down to -{o.overlong_penalty:g}" if o.overlong_buffer_frac
        else "overlong=off",
        f"entropy_coef={t.entropy_coef:g}",
        f"kl_coef={t.kl_coef:g}" + (f" ({t.kl_estimator})" if t.kl_coef else ""),
        *([f"teacher={a.teacher.path} (reward_weight {a.teacher.reward_weight:g})"] if a.teacher.path else []),
        f"aux_loss_coef={t.aux_loss_coef:g}",
        f"lr={t.lr:g}",
    ]
    return f"{cfg.algorithm.name}: " + ", ".join(parts)


MIN_OVERLONG_RAMP = 16
"""Below this many tokens DAPO's overlong ramp is a cliff, not a ramp: the plan warns."""


def check_algorithm(cfg: Any, *, pretrained: bool = True) -> list[str]:
    """Plan time: ValueError naming the key for a combination that cannot run; the warnings for a
    user's checkpoint (``model.path``) trained with settings that drift it (``pretrained=False``: the
    checkpoint was never trained, its norms at their init: no learning-rate warning), and for DAPO's
    overlong ramp over so few tokens that most samples of a short generation limit are penalised."""
    t, a = cfg.trainer, cfg.algorithm
    distill = a.name == "on_policy_distill"
    if distill and not a.teacher.path:
        raise ValueError("algorithm=on_policy_distill needs algorithm.teacher.path=DIR (the teacher's Hugging Face "
                         "checkpoint, with the student's tokenizer)")
    if a.teacher.path and not distill:
        raise ValueError(f"algorithm.teacher.path={a.teacher.path} is read only by algorithm=on_policy_distill "
                         f"(this run is algorithm={a.name})")
    backend = cfg.inference.backend
    for key, on in (("algorithm=on_policy_distill", distill), (f"trainer.kl_coef={t.kl_coef:g}", t.kl_coef > 0)):
        if on and backend != "embedded":
            raise ValueError(
                f"{key}: the {'teacher' if distill else 'reference'} policy is scored by an embedded engine beside the "
                f"orchestrator; an inference.backend={backend} group for it is not placed yet: use "
                f"inference=embedded, or {'another algorithm' if distill else 'trainer.kl_coef=0'}")
    warnings = []
    path = getattr(cfg.model, "path", "")
    if path and pretrained and t.lr > PRETRAINED_LR_MAX:
        warnings.append(
            f"trainer.lr={t.lr:g} with model.path={path}: RL on a pretrained checkpoint usually uses trainer.lr in "
            f"1e-7..1e-5 (rarely above {PRETRAINED_LR_MAX:g}); at this rate the policy drifts within a few steps")
    if path and t.aux_loss_coef > 0:
        warnings.append(
            f"trainer.aux_loss_coef={t.aux_loss_coef:g} with model.path={path}: the MoE balance loss moves the "
            f"router even when no reward differs; RL usually runs with trainer.aux_loss_coef=0")
    o, limit = cfg.orchestrator, getattr(cfg.env, "max_new_tokens", None)
    if o.overlong_buffer_frac > 0 and o.overlong_penalty > 0 and isinstance(limit, int) and limit > 0:
        ramp = max(1, round(o.overlong_buffer_frac * limit))
        if ramp < MIN_OVERLONG_RAMP:
            warnings.append(
                f"orchestrator.overlong_buffer_frac={o.overlong_buffer_frac:g} of env.max_new_tokens={limit} is a "
                f"ramp of {ramp} token(s): every sample longer than {limit - ramp} tokens is penalised, one that "
                f"reaches the limit (what an untrained or small model mostly does) by -{o.overlong_penalty:g}, "
                f"which can outweigh the task reward of most samples (DAPO's ramp: 4096 of 20480 tokens); raise "
                f"env.max_new_tokens or set orchestrator.overlong_buffer_frac=0")
    return warnings
