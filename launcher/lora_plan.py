"""The plan's view of a LoRA run (``trainer.lora.rank > 0``): checks, trainable parameters, trainer
memory per GPU and bytes per weight update, from the family's architecture facts. Torch-free.

Counts (workers/models/facts.py Architecture; per adapted projection ``in -> out`` the adapter is
``r * (in + out)``): attention per its kind (GQA q/k/v/o; MLA q_a/q_b or q, kv_a, kv_b, o), the dense
MLPs (dense models only: workers/common/config/lora.py says why not on MoE models), the routed
experts (``per_expert``: ``E * r * (H + 2I)`` into gate/up plus ``E * r * (I + H)`` out of down;
``shared_outer``: the hidden-side factors once). Mamba and latent projections are not in the
architecture facts and are not counted. Published adapters are the per-expert layout (expanded), in
``trainer.dtype``.

Memory per trainer GPU (FSDP2 shards everything over the trainer ranks): the frozen base in
``trainer.dtype`` (no float32 master, no gradient, no AdamW state) plus 16 B per adapter parameter
(float32 adapter, gradient, AdamW m and v).
"""
from __future__ import annotations

import dataclasses

from launcher.estimate import DTYPE_BYTES, TRAIN_BYTES_PER_PARAM, MemoryEstimate, human
from launcher.resources import PlanError
from workers.common.config.lora import (EXPERTS, FULL_FT_LR_MAX, MLP_NAMES, SHARED_OUTER, linear_targets,
                                        several_adapters_error)
from workers.common.registry import BACKENDS
from workers.common.config.ranges import ConfigError
from workers.models.spec import architecture


@dataclasses.dataclass(frozen=True)
class LoraFacts:
    trainable: int
    """Adapter parameters the trainer holds and steps (shared_outer: the shared factors once)."""
    published: int
    """Adapter parameters in one published step (the per-expert layout)."""
    base: int
    """Frozen base parameters (all of the model's, MTP included)."""


def _attention(a) -> dict[str, tuple[int, int]]:
    h = a.hidden_size
    if a.attention == "mha":
        hd = a.mha_head_dim
        kv = (a.num_kv_heads or a.num_heads) * hd
        return {"q_proj": (h, a.num_heads * hd), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (a.num_heads * hd, h)}
    qk = a.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim)
    out = ({"q_a_proj": (h, a.q_lora_rank), "q_b_proj": (a.q_lora_rank, qk)} if a.q_lora_rank else {"q_proj": (h, qk)})
    out.update(kv_a_proj_with_mqa=(h, a.kv_lora_rank + a.qk_rope_head_dim),
               kv_b_proj=(a.kv_lora_rank, a.num_heads * (a.qk_nope_head_dim + a.v_head_dim)),
               o_proj=(a.num_heads * a.v_head_dim, h))
    return out


def lora_facts(cfg) -> LoraFacts:
    """Adapter sizes of ``cfg`` (a LoRA run); ConfigError naming trainer.lora.targets when nothing is adapted."""
    lcfg, a = cfg.trainer.lora, architecture(cfg.model)
    r, h = lcfg.rank, a.hidden_size
    names = linear_targets(lcfg.targets, moe=a.is_moe)
    per_layer = sum(r * (i + o) for n, (i, o) in _attention(a).items() if n in names)
    n = a.num_layers * per_layer
    dense_layers = a.num_layers - a.num_moe_layers
    inter = a.dense_intermediate_size
    n += dense_layers * sum(r * (h + inter) for m in MLP_NAMES if m in names)
    trained = published = n
    if EXPERTS in lcfg.targets and a.is_moe:
        e, i = a.num_experts, a.expert_intermediate_size
        full = e * r * (h + 2 * i) + e * r * (i + h)
        published += a.num_moe_layers * full
        trained += a.num_moe_layers * (r * h + e * 2 * i * r + e * r * i + h * r if lcfg.experts == SHARED_OUTER else full)
    params = a.params()
    if trained == 0:
        raise ConfigError(f"trainer.lora.targets={list(lcfg.targets)} adapts nothing in model family {cfg.model.family} "
                          f"(its projections: {sorted(_attention(a))}"
                          + (", experts" if a.is_moe else f", {list(MLP_NAMES)}") + ")")
    n = max(1, len(lcfg.adapters))  # several adapters (trainer.lora.adapters): N of them, side by side
    return LoraFacts(trainable=trained * n, published=published * n, base=params.total + params.mtp)


def check_lora(cfg) -> list[str]:
    """PlanError for a LoRA setting the trainer refuses; the plan's warnings (the learning-rate hint)."""
    lcfg, t = cfg.trainer.lora, cfg.trainer
    if not lcfg.enabled:
        return []
    par = t.parallel
    if par.tp > 1 or par.ep > 1:
        raise PlanError(f"trainer.lora.rank={lcfg.rank} with trainer.parallel.tp={par.tp} / trainer.parallel.ep={par.ep}: "
                        f"LoRA runs on the FSDP plan only for now (tp = ep = 1; dp and cp are fine): set "
                        f"trainer.parallel.tp=1 and trainer.parallel.ep=1, or trainer.lora.rank=0")
    why = several_adapters_error(cfg)
    if why:
        raise PlanError(why)
    try:
        lora_facts(cfg)
    except ConfigError as e:
        raise PlanError(str(e)) from None
    if t.lr <= FULL_FT_LR_MAX:
        return [f"trainer.lr={t.lr:g} looks like a full-fine-tuning learning rate, and trainer.lora.rank={lcfg.rank}: "
                f"LoRA needs about 10x the full fine-tuning lr for RL (public result: 'LoRA Without Regret', "
                f"Thinking Machines 2025), e.g. trainer.lr={t.lr * 10:g}"]
    return []


def trainer_memory(cfg, num_gpus: int, gpu_gb: float) -> MemoryEstimate:
    """Per trainer GPU: the frozen base in trainer.dtype + 16 B per adapter parameter (module docstring)."""
    f = lora_facts(cfg)
    base_b = DTYPE_BYTES[cfg.trainer.dtype]
    per_gpu = (f.base * base_b + f.trainable * TRAIN_BYTES_PER_PARAM) / num_gpus / 1e9
    return MemoryEstimate(what="trainer", per_gpu_gb=per_gpu, gpu_gb=gpu_gb,
                          detail=f"{states_formula(cfg, num_gpus)} = {per_gpu:.1f} GB/GPU of {gpu_gb:.0f} "
                                 f"({gpu_gb - per_gpu:.0f} GB left for activations)")


def states_formula(cfg, num_gpus: int) -> str:
    f = lora_facts(cfg)
    return (f"(frozen {cfg.trainer.dtype} base {DTYPE_BYTES[cfg.trainer.dtype]} B x {human(f.base)} + LoRA "
            f"{TRAIN_BYTES_PER_PARAM} B x {human(f.trainable)} adapter params) / {num_gpus} GPUs")


def summary_line(cfg) -> str:
    """``lora: ...`` for the plan summary: trainable parameters, memory per rank, bytes per update."""
    lcfg, f = cfg.trainer.lora, lora_facts(cfg)
    b = DTYPE_BYTES[cfg.trainer.dtype]
    n = cfg.trainer.num_ranks
    mem = (f.base * b + f.trainable * TRAIN_BYTES_PER_PARAM) / n / 1e9
    several = (f"{len(lcfg.adapters)} adapters {list(lcfg.adapters)} on one frozen base (one env=mix entry each), "
               if lcfg.adapters else "")
    return (f"lora: {several}rank {lcfg.rank}, alpha {lcfg.alpha:g}, targets {list(lcfg.targets)}, experts {lcfg.experts}: "
            f"{human(f.trainable)} trainable params ({100 * f.trainable / f.base:.3g}% of {human(f.base)}); trainer "
            f"states {mem:.3g} GB/rank over {n} rank(s) (frozen {cfg.trainer.dtype} base, no fp32 master; fp32 "
            f"adapters + AdamW)")


def _bytes(n: float) -> str:
    return f"{n / 1e9:.3g} GB" if n >= 1e9 else f"{n / 1e6:.3g} MB"


def update_line(cfg) -> str:
    """The plan's ``weights:`` line in LoRA mode: an update is the adapter (after the step-0 base), read by
    every server from run_dir/weights (SGLang: ``/load_lora_adapter``; embedded: unmerged buffers), its
    bytes against the dense model's, and the read time at ``cluster.shared_fs_gb_s``."""
    f = lora_facts(cfg)
    b = DTYPE_BYTES[cfg.trainer.dtype]
    adapter, dense = f.published * b, f.base * b
    backend = BACKENDS.get(cfg.inference.backend)
    how = ("SGLang /load_lora_adapter" if "sglang" in (backend.name, *backend.serves_api_of)
           else "/update_weights_from_disk, unmerged")
    fs = cfg.cluster.shared_fs_gb_s
    names = list(cfg.trainer.lora.adapters)
    what = (f"the {len(names)} adapters {names} (weights/step_N/adapters/<name>/, {_bytes(adapter / len(names))} each)"
            if names else "the adapter")
    return (f"LoRA rank {cfg.trainer.lora.rank}: every update is {what}, {_bytes(adapter)} in {cfg.trainer.dtype} "
            f"vs {_bytes(dense)} dense ({100 * adapter / dense:.3g}%), read by each server ({how}; "
            f"~{adapter / (fs * 1e9):.3f} s at cluster.shared_fs_gb_s={fs:g}); step 0 publishes the base; each "
            f"version is confirmed by the digest of what the engine holds before it is sampled")
