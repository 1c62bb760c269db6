"""Plan-time model checks: the ones every family shares, and building blocks families compose.

Pure (no torch): the launcher calls them through the registry. Each raises ValueError with a
message naming the config key and the numbers; launcher/plan.py turns it into a PlanError.
:func:`check_base` runs for every family first (``ModelSpec.check`` adds the family's own);
the other functions are what a family's check calls for the blocks it has.
"""
from __future__ import annotations

from workers.common.config.ranges import positive  # the families' checks take it from here too
from workers.models.pretrained import SOURCES as PRETRAINED_SOURCES
from workers.models.pretrained import fact_mismatches


def check_base(cfg, spec) -> None:
    """What holds for every family: positive sizes, a loadable pretrained source, MoE-only options
    (Router Replay, expert parallelism) asked of a MoE model, and something to build when a run starts."""
    m = cfg.model
    for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "max_position_embeddings"):
        positive(f"model.{key}", getattr(m, key))
    if m.pretrained and m.path:
        raise ValueError(f"model.pretrained={m.pretrained} and model.path={m.path} both name the starting weights; "
                         f"set one")
    if m.pretrained:
        check_pretrained(cfg)
    elif m.pretrained_dir:
        raise ValueError(f"model.pretrained_dir={m.pretrained_dir} is set but model.pretrained is empty: it only says "
                         f"where a model.pretrained source is converted; to start from a Hugging Face "
                         f"checkpoint directory use model.path={m.pretrained_dir}")
    if m.num_experts == 0:  # dense: nothing routes, so nothing can be replayed or expert-split
        if cfg.trainer.router_replay:
            raise ValueError(f"trainer.router_replay=true needs a MoE model; model {m.name} "
                             f"(model.family={m.family}) is dense")
        if cfg.trainer.parallel.ep != 1:
            raise ValueError(f"trainer.parallel.ep({cfg.trainer.parallel.ep}) must be 1 for a dense model "
                             f"(model.family={m.family}: no experts)")
    if not spec.buildable and not cfg.launcher.dry_run:
        raise ValueError(f"model.family={m.family} (model {m.name}) can be planned but not built yet: the trainer "
                         f"and the embedded engine build {' and '.join(buildable_families())}; plan it with "
                         f"launcher.dry_run=true")


def buildable_families() -> list[str]:
    from workers.common.registry import MODELS

    return [s.name for s in MODELS.specs() if s.buildable]


def check_pretrained(cfg) -> None:
    """model.pretrained: a known source of this family whose architecture facts the preset repeats exactly."""
    m = cfg.model
    if m.pretrained not in PRETRAINED_SOURCES:
        raise ValueError(f"model.pretrained={m.pretrained!r} is unknown; choose one of {sorted(PRETRAINED_SOURCES)}")
    src = PRETRAINED_SOURCES[m.pretrained]
    if src.family != m.family:
        raise ValueError(f"model.pretrained={m.pretrained} is a {src.family} checkpoint; model.family={m.family} "
                         f"cannot load it")
    wrong = fact_mismatches(m.pretrained, m)
    if wrong:
        raise ValueError(f"model preset {m.name} does not describe the checkpoint it loads: " + "; ".join(wrong))


def check_gqa(m) -> None:
    """num_kv_heads: 0 (= num_heads) or a divisor of num_heads."""
    positive("model.num_kv_heads", m.num_kv_heads, allow_zero=True)
    if m.num_kv_heads and m.num_heads % m.num_kv_heads:
        raise ValueError(f"model.num_kv_heads({m.num_kv_heads}) must divide model.num_heads({m.num_heads})")


def check_mha(m) -> None:
    """Heads of hidden_size / num_heads, an even width (rotary embedding)."""
    if m.hidden_size % m.num_heads:
        raise ValueError(f"model.num_heads({m.num_heads}) must divide model.hidden_size({m.hidden_size})")
    if (m.hidden_size // m.num_heads) % 2:
        raise ValueError(f"model.hidden_size/num_heads = {m.hidden_size // m.num_heads} must be even (rotary embedding)")


def check_mla(m) -> None:
    """MLA widths > 0 (q_lora_rank 0: a full query projection); an even rotary width."""
    positive("model.q_lora_rank", m.q_lora_rank, allow_zero=True)
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        positive(f"model.{key}", getattr(m, key))
    if m.qk_rope_head_dim % 2:
        raise ValueError(f"model.qk_rope_head_dim({m.qk_rope_head_dim}) must be even (rotary embedding)")


def check_sigmoid_router(m) -> None:
    """Grouped top-k: the experts split into num_expert_groups, the kept groups hold top_k experts."""
    g, kept = m.num_expert_groups, m.topk_groups
    if m.num_experts % g:
        raise ValueError(f"model.num_expert_groups({g}) must divide model.num_experts({m.num_experts})")
    if kept > g:
        raise ValueError(f"model.topk_groups({kept}) must be <= model.num_expert_groups({g})")
    if m.top_k > kept * (m.num_experts // g):
        raise ValueError(f"model.top_k({m.top_k}) must be <= experts in the kept groups: topk_groups({kept}) * "
                         f"num_experts/num_expert_groups({m.num_experts // g})")
    if g > 1 and m.num_experts // g < 2:
        raise ValueError(f"model.num_expert_groups({g}) must leave >= 2 experts per group (a group scores its best two)")


def check_moe(m) -> None:
    """Routed experts: positive sizes, top_k <= num_experts, expert ids that fit the uint16 records."""
    for key in ("num_experts", "top_k", "expert_intermediate_size"):
        positive(f"model.{key}", getattr(m, key))
    if m.top_k > m.num_experts:
        raise ValueError(f"model.top_k({m.top_k}) must be <= model.num_experts({m.num_experts})")
    if m.num_experts > 65535:
        raise ValueError(f"model.num_experts({m.num_experts}) must fit uint16 routed-expert records")


def check_dense_layers(m) -> None:
    """Leading dense layers of a MoE model (DeepSeek/GLM ``first_k_dense_replace``)."""
    if not 0 <= m.num_dense_layers < m.num_layers:
        raise ValueError(f"model.num_dense_layers({m.num_dense_layers}) must be in [0, model.num_layers({m.num_layers}))")
    if m.num_dense_layers and m.dense_intermediate_size <= 0:
        raise ValueError(f"model.dense_intermediate_size must be > 0 with model.num_dense_layers={m.num_dense_layers}")
