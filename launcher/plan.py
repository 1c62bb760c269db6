"""build_plan(cfg) -> JobPlan: which processes run, how many, and every cross-role check.

Pure function of the config (no I/O, no torch): the same plan drives the local backend,
the sbatch renderer and the dry run. A user mistake raises :class:`PlanError` naming the
config key and the numbers involved, before anything is started or written.
"""
from __future__ import annotations

import dataclasses

from workers.common.config import RunConfig

ENV_VOCAB = {"reverse_digits": lambda e: 4 + e.num_symbols}
CHOICES = {
    "cluster.backend": ("local", "slurm"),
    "inference.backend": ("embedded", "sglang"),
    "inference.dtype": ("float32", "bfloat16"),
    "trainer.dtype": ("float32", "bfloat16"),
    "weights.transport": ("filesystem",),
    "orchestrator.advantage": ("sequence", "token_rtg"),
}


class PlanError(ValueError):
    """The config cannot be planned; the message names the key."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolePlan:
    role: str
    """orchestrator | inference | trainer."""
    num_procs: int
    """Processes of this role."""
    module: str
    """``python -m`` module that runs one process of the role."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobPlan:
    experiment: str
    backend: str
    roles: tuple[RolePlan, ...]
    num_params: int
    """Model parameters (printed by the launcher)."""
    samples_per_step: int

    def role(self, name: str) -> RolePlan:
        return next(r for r in self.roles if r.role == name)


def _positive(key: str, value: float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise PlanError(f"{key} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def check_choices(cfg: RunConfig) -> None:
    for key, choices in CHOICES.items():
        section, field = key.split(".")
        value = getattr(getattr(cfg, section), field)
        if value not in choices:
            raise PlanError(f"{key}={value!r} is not supported; choose one of {list(choices)}")


def check_model(cfg: RunConfig) -> None:
    m = cfg.model
    for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_experts", "top_k",
                "expert_intermediate_size", "max_position_embeddings"):
        _positive(f"model.{key}", getattr(m, key))
    if m.hidden_size % m.num_heads:
        raise PlanError(f"model.num_heads({m.num_heads}) must divide model.hidden_size({m.hidden_size})")
    if (m.hidden_size // m.num_heads) % 2:
        raise PlanError(f"model.hidden_size/num_heads = {m.hidden_size // m.num_heads} must be even (rotary embedding)")
    if m.top_k > m.num_experts:
        raise PlanError(f"model.top_k({m.top_k}) must be <= model.num_experts({m.num_experts})")
    if m.num_experts > 65535:
        raise PlanError(f"model.num_experts({m.num_experts}) must fit uint16 routed-expert records")


def check_env(cfg: RunConfig) -> None:
    e = cfg.env
    if e.name not in ENV_VOCAB:
        raise PlanError(f"env.name={e.name!r} is unknown; choose one of {sorted(ENV_VOCAB)}")
    _positive("env.min_digits", e.min_digits)
    if e.max_digits < e.min_digits:
        raise PlanError(f"env.max_digits({e.max_digits}) must be >= env.min_digits({e.min_digits})")
    _positive("env.num_symbols", e.num_symbols)
    need = ENV_VOCAB[e.name](e)
    if need > cfg.model.vocab_size:
        raise PlanError(f"model.vocab_size({cfg.model.vocab_size}) is smaller than env {e.name}'s vocabulary ({need})")
    longest = 2 + e.max_digits + e.max_digits + 1
    if longest > cfg.model.max_position_embeddings:
        raise PlanError(f"model.max_position_embeddings({cfg.model.max_position_embeddings}) < longest episode "
                        f"({longest} tokens for env.max_digits={e.max_digits})")


def check_loop(cfg: RunConfig) -> int:
    o, t, i = cfg.orchestrator, cfg.trainer, cfg.inference
    _positive("orchestrator.num_prompts_per_step", o.num_prompts_per_step)
    _positive("orchestrator.num_samples_per_prompt", o.num_samples_per_prompt)
    _positive("orchestrator.max_off_policy_steps", o.max_off_policy_steps, allow_zero=True)
    _positive("orchestrator.temperature", o.temperature)
    _positive("orchestrator.request_timeout_s", o.request_timeout_s)
    samples = o.num_prompts_per_step * o.num_samples_per_prompt
    if o.max_inflight_rollouts < o.num_samples_per_prompt:
        raise PlanError(f"orchestrator.max_inflight_rollouts({o.max_inflight_rollouts}) must hold at least one prompt "
                        f"group (orchestrator.num_samples_per_prompt={o.num_samples_per_prompt})")
    if o.num_samples_per_prompt < 2:
        raise PlanError("orchestrator.num_samples_per_prompt must be >= 2: advantages are relative to the prompt's group")
    _positive("trainer.num_ranks", t.num_ranks)
    _positive("trainer.num_steps", t.num_steps)
    _positive("trainer.lr", t.lr)
    _positive("trainer.grad_clip", t.grad_clip)
    if t.num_ranks > samples:
        raise PlanError(f"trainer.num_ranks({t.num_ranks}) > samples per step ({samples} = orchestrator."
                        f"num_prompts_per_step({o.num_prompts_per_step}) * num_samples_per_prompt({o.num_samples_per_prompt}))")
    if not 0 < t.ratio_mask_low <= 1 <= t.ratio_cap <= t.ratio_mask_high:
        raise PlanError(f"need 0 < trainer.ratio_mask_low({t.ratio_mask_low}) <= 1 <= trainer.ratio_cap({t.ratio_cap}) "
                        f"<= trainer.ratio_mask_high({t.ratio_mask_high})")
    _positive("inference.num_workers", i.num_workers)
    _positive("inference.max_batch_size", i.max_batch_size)
    _positive("weights.keep_last", cfg.weights.keep_last)
    if cfg.weights.keep_last < 2:
        raise PlanError(f"weights.keep_last({cfg.weights.keep_last}) must be >= 2 so a step being loaded is never pruned")
    return samples


def estimate_params(cfg: RunConfig) -> int:
    m = cfg.model
    attn = 4 * m.hidden_size * m.hidden_size
    moe = m.num_experts * 3 * m.hidden_size * m.expert_intermediate_size + m.hidden_size * m.num_experts
    return m.num_layers * (attn + moe + 2 * m.hidden_size) + 2 * m.vocab_size * m.hidden_size + m.hidden_size


def build_plan(cfg: RunConfig) -> JobPlan:
    check_choices(cfg)
    check_model(cfg)
    check_env(cfg)
    samples = check_loop(cfg)
    if cfg.inference.backend != "embedded" and cfg.cluster.backend == "local":
        raise PlanError(f"inference.backend={cfg.inference.backend!r} needs GPUs; cluster=local runs only 'embedded'")
    roles = (
        RolePlan(role="trainer", num_procs=cfg.trainer.num_ranks, module="workers.trainer"),
        RolePlan(role="inference", num_procs=cfg.inference.num_workers, module="workers.inference"),
        RolePlan(role="orchestrator", num_procs=1, module="workers.orchestrator"),
    )
    return JobPlan(experiment=cfg.experiment, backend=cfg.cluster.backend, roles=roles,
                   num_params=estimate_params(cfg), samples_per_step=samples)
