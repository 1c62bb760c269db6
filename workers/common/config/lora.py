"""``trainer.lora``: LoRA adapters instead of full fine-tuning (issue 44). Torch-free: the launcher's
plan and every trainer rank resolve the same targets from here.

Why LoRA for RL: public results (Thinking Machines' "LoRA Without Regret", 2025) find that for
RL a small rank matches full fine-tuning when its learning rate is about 10x the full one, and
the base then stays frozen in the compute dtype (no float32 master, no gradient, no AdamW state)
while a weight update is the adapter, not the model. ``rank`` 0 (the default) is full fine-tuning.

Targets: names of the projections to adapt. Group names expand per family so one default fits
every native family: ``attention`` (q/k/v/o of GQA; q_a/q_b/kv_a/kv_b/o of MLA), ``mlp`` (the
dense MLPs' and shared experts' gate/up/down), ``mamba`` (Mamba-2 in/out projections, Nemotron-H),
``latent`` (Nemotron-H's latent MoE projections), ``experts`` (every routed-expert stack); or the
projection names themselves (``q_proj``, ``down_proj``...). On a model with routed experts the
``mlp`` names adapt nothing (dense layers, shared experts) and are refused when named explicitly:
peft 0.21 under transformers 5 reads them as the MoE's v4 expert names (:data:`PEFT_MOE_NOTE`), so
such an adapter would not load onto the user's checkpoint. The router (``gate``) is never adapted:
a LoRA on it moves routing, which Router Replay and the IS corrections assume the trainer and
inference share; it is refused by name. Embeddings and the LM head are not offered either (PEFT's
LoRA on them is a different layer type that SGLang does not serve).
"""
from __future__ import annotations

import dataclasses
from dataclasses import field

from workers.common.config.ranges import ConfigError, Each, Pattern, between, gt, limits, one_of

TARGET_GROUPS = {
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
    "mamba": ("in_proj", "out_proj"),
    "latent": ("fc1_latent_proj", "fc2_latent_proj"),
}
"""Group target -> the ``nn.Linear`` leaf names (HF names) it adapts, in every family that has them."""
EXPERTS = "experts"
LINEAR_TARGETS = tuple(dict.fromkeys(n for names in TARGET_GROUPS.values() for n in names))
TARGETS = (*TARGET_GROUPS, EXPERTS, *LINEAR_TARGETS)
"""``trainer.lora.targets`` choices."""
ROUTER_NAMES = ("gate", "router", "mlp.gate", "e_score_correction_bias")
"""What a user may write for the router; refused with a reason (module docstring)."""
PER_EXPERT, SHARED_OUTER = "per_expert", "shared_outer"
EXPERT_MODES = (PER_EXPERT, SHARED_OUTER)
"""``trainer.lora.experts`` choices (workers/trainer/lora/experts.py explains them)."""
ADAPTER_NAME = Pattern(r"[A-Za-z][A-Za-z0-9_-]{0,31}", "an adapter name: a letter, then up to 31 letters, digits, "
                       "'_' or '-' (it names a directory and a request's lora_path)")
MAX_ADAPTERS = 8
"""Most adapters in one run (``trainer.lora.adapters``): the engine's per-target buffers are ``N * rank``
wide and every row's LoRA product spans all of them (workers/models/lora/linear.py)."""
RESERVED_NAMES = ("base", "default")
"""Names a request's ``lora_path`` already means something for (the base alone; the single adapter)."""
FULL_FT_LR_MAX = 2e-5
"""A LoRA run at or below this learning rate gets the plan's hint: full-fine-tuning RL recipes use
1e-6..1e-5 (GRPO/DAPO presets), and LoRA needs ~10x the full learning rate (module docstring)."""


@dataclasses.dataclass(kw_only=True)
class LoraConfig:
    rank: int = 0
    """LoRA rank r; 0 (default): full fine-tuning (every parameter trained, float32 master). > 0: the
    base is frozen in trainer.dtype and each target learns ``B @ A`` (A [r, in], B [out, r], B zero at
    step 0), scaled by alpha / r; published steps are PEFT adapters (workers/weights/lora_format.py).
    Public RL results: rank 1-32 matches full fine-tuning on small models, 32-128 at 30B+."""
    alpha: float = 32.0
    """LoRA scale numerator: the update is ``(alpha / rank) * B @ A`` (PEFT's ``lora_alpha``; a fixed
    alpha keeps the best learning rate nearly independent of the rank)."""
    dropout: float = 0.0
    """Dropout on each adapter's input while training (PEFT's ``lora_dropout``); 0 for RL (dropout
    changes the trainer's log-probs against inference's). Not applied to expert adapters (peft's
    expert LoRA has none; published as 0 there)."""
    targets: list[str] = field(default_factory=lambda: ["attention", "mlp", "experts"])
    """What to adapt: groups ``attention``, ``mlp``, ``mamba``, ``latent``, ``experts`` or projection
    names (``q_proj``, ``v_proj``, ``down_proj``...); targets a family lacks are skipped, but at least one
    must exist in the model. The router is refused; on a MoE model ``mlp`` adapts nothing and its names
    are refused (peft could not load them onto the checkpoint: workers/common/config/lora.py)."""
    experts: str = "per_expert"
    """Routed-expert adapters: ``per_expert`` (each expert its own A [E, r, in] and B [E, out, r]) or
    ``shared_outer`` (the hidden-size side shared by all experts: one A [r, hidden] into gate/up and
    one B [hidden, r] out of down, the expert-width side per expert; about half the adapter bytes of
    per_expert at E >> 1; published expanded to the per-expert PEFT layout)."""
    adapters: list[str] = field(default_factory=list)
    """Several adapters trained in one run on one frozen base (empty, the default: one adapter, named
    ``default``). Each name is an entry of ``env=mix``'s ``env.envs`` (its own env and reward), so a
    group drawn from entry ``a`` is sampled with adapter ``a`` (the request names it) and trains adapter
    ``a`` only; ``env.weights`` sets each adapter's share of a step's groups. 2 to 8 unique names
    (letters, digits, ``_``, ``-``; not ``base`` or ``default``); published as
    ``weights/step_N/adapters/<name>/`` (workers/weights/lora_steps.py); the embedded engine and SGLang
    servers (each loaded as ``<name>@v<N>``) serve all of them at once. Dense and attention targets only on
    a MoE model (routed-expert adapters are one per run)."""

    def __post_init__(self) -> None:
        if isinstance(self.adapters, str):
            self.adapters = [self.adapters]
        check_adapter_names(list(self.adapters), self.rank)
        if isinstance(self.targets, str):  # a Hydra override ``trainer.lora.targets=q_proj`` without brackets
            self.targets = [self.targets]
        for t in self.targets:
            if t in ROUTER_NAMES:
                raise ConfigError(f"trainer.lora.targets has {t!r}: the MoE router is never adapted (a LoRA on it "
                                  f"moves routing, which Router Replay and the IS corrections assume trainer and "
                                  f"inference share); choose from {list(TARGETS)}")
        if self.rank > 0 and not self.targets:
            raise ConfigError("trainer.lora.targets is empty with trainer.lora.rank > 0: name what to adapt, "
                              f"e.g. [attention, mlp, experts]; choose from {list(TARGETS)}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def check_adapter_names(names: list[str], rank: int) -> None:
    """ConfigError naming ``trainer.lora.adapters`` for a list that cannot name N adapters of one run."""
    if not names:
        return
    key = f"trainer.lora.adapters={names}"
    if rank <= 0:
        raise ConfigError(f"{key} with trainer.lora.rank=0: several adapters are LoRA adapters; set "
                          f"trainer.lora.rank > 0 (e.g. 8)")
    if not 2 <= len(names) <= MAX_ADAPTERS:
        raise ConfigError(f"{key}: name 2 to {MAX_ADAPTERS} adapters (one adapter: leave it empty)")
    for n in names:
        why = ADAPTER_NAME.error(n)
        if why or n in RESERVED_NAMES:
            raise ConfigError(f"{key}: {n!r} {why or f'is reserved ({list(RESERVED_NAMES)} mean the base and the single adapter)'}")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"{key}: names must be unique, {dup} repeat")


def several_adapters_error(cfg) -> str | None:
    """Why this run cannot train ``trainer.lora.adapters`` (None: it can, or it names none): each adapter
    is an ``env=mix`` entry of the same name, context parallelism is off (the per-token adapter ids are not split
    over cp ranks), and routed-expert adapters stay one per run (workers/models/lora/rows.py)."""
    names = list(cfg.trainer.lora.adapters)
    if not names or not cfg.trainer.lora.enabled:
        return None
    key = f"trainer.lora.adapters={names}"
    env = cfg.env
    labels = sorted(getattr(env, "envs", None) or {}) if env.name == "mix" else None
    if labels is None:
        return (f"{key} with env={env.name}: each adapter trains on its own env; use env=mix with one env.envs "
                f"entry per adapter, named like it (env.envs.{names[0]}: {{name: reverse_digits, ...}})")
    if labels != sorted(names):
        return (f"{key}: env.envs labels are {labels}; they must be the adapters' names (one env per adapter, "
                f"env.weights sets each adapter's share of a step)")
    if cfg.trainer.parallel.cp > 1:
        return (f"{key} with trainer.parallel.cp={cfg.trainer.parallel.cp}: several adapters run with context "
                f"parallelism off for now (trainer.parallel.cp=1)")
    if EXPERTS in cfg.trainer.lora.targets and (cfg.model.num_experts or 0) > 0:
        return (f"{key} with trainer.lora.targets={list(cfg.trainer.lora.targets)} on a MoE model: several adapters "
                f"adapt dense projections only (routed-expert adapters are one per run); set "
                f"trainer.lora.targets=[attention]")
    return None


MLP_NAMES = TARGET_GROUPS["mlp"]
PEFT_MOE_NOTE = ("peft 0.21 under transformers 5 reads gate_proj/up_proj/down_proj on a MoE model as the v4 names of "
                 "its routed experts (it remaps them onto the stacked experts with a doubled rank), so an adapter on a "
                 "MoE model's dense MLP or shared expert could not be loaded onto the original checkpoint")
"""Why the ``mlp`` group adapts nothing on a model with routed experts (qwen3_moe, deepseek_v3, glm_moe_dsa
map to transformers' qwen2_moe conversion; the rule holds for every MoE family, so one layout fits all)."""


def linear_targets(targets, *, moe: bool = False) -> frozenset[str]:
    """The ``nn.Linear`` leaf names ``targets`` (groups or names) adapt; ``moe``: the model has routed
    experts, where the dense-MLP names are left out (:data:`PEFT_MOE_NOTE`) and refused when named."""
    out = set()
    for t in targets:
        out.update(TARGET_GROUPS.get(t, () if t == EXPERTS else (t,)))
    if moe:
        named = sorted(set(targets) & set(MLP_NAMES))
        if named:
            raise ConfigError(f"trainer.lora.targets has {named} on a MoE model: {PEFT_MOE_NOTE}; adapt the experts "
                              f"with 'experts' (and attention with 'attention')")
        out -= set(MLP_NAMES)
    return frozenset(out)


def adapts_experts(targets) -> bool:
    return EXPERTS in targets


limits(LoraConfig, rank=between(0, 4096), alpha=gt(0), dropout=between(0, 1, hi_open=True),
       targets=Each(one_of(*TARGETS)), experts=one_of(*EXPERT_MODES), adapters=Each(ADAPTER_NAME))
