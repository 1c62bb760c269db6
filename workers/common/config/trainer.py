"""Trainer section: optimisation, loss, checkpoints and the parallel layout (``trainer/`` Hydra group)."""
from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Optional

from workers.common.config.lora import LoraConfig
from workers.common.config.ranges import ConfigError, Each, Range, between, ge, gt, limits, one_of
from workers.common.dtypes import COMPUTE_DTYPES

MASTER_DTYPES = ("float32", "bfloat16")
"""``trainer.master_dtype`` choices (workers/trainer/precision.py explains them)."""
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
"""``trainer.activation_checkpointing`` choices."""
COMPILE = ("none", "layers", "auto")
"""``trainer.compile`` choices (workers/trainer/compile.py)."""
LOGPROB_HEADS = ("fused_loss", "fused", "checkpoint")
"""``trainer.logprob_head`` choices (workers/models/blocks/fused_logprobs.py, logprobs.py)."""
LOSS_AGG = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")
"""``trainer.loss_agg`` choices (workers/trainer/objective.py)."""
KL_ESTIMATORS = ("k1", "k2", "k3")
"""``trainer.kl_estimator`` choices (workers/trainer/objective.py)."""


@dataclasses.dataclass(kw_only=True)
class ParallelConfig:
    """How trainer ranks split the model: tp * pp * ep * cp * dp == trainer.num_ranks, checked once here.

    Read by the launcher (placement, the plan summary) and by every trainer rank (its groups);
    both call :meth:`resolve`, so a layout that passes the plan is the one the ranks build.
    """

    tp: int = 1
    """Tensor parallel size (inside a node: NVLink); divides model.num_heads."""
    pp: int = 1
    """Pipeline parallel stages; the trainer has none yet, so anything but 1 is refused at plan time."""
    ep: int = 1
    """Expert parallel size: routed experts are split over ep ranks; divides model.num_experts."""
    cp: int = 1
    """Context parallel size: each sequence is split into cp contiguous chunks, one per rank, with
    Ulysses all-to-alls over heads around attention / Mamba (workers/trainer/parallel/context.py; attention
    with fewer heads than cp gathers keys/values instead); divides model.max_position_embeddings and a
    hybrid's model.mamba_num_heads; with tp/ep > 1 a dimension of the mesh plan (heads split over tp, then cp)."""
    dp: int = -1
    """Data-parallel replicas of each (tp, pp, ep, cp) shard; -1 derives num_ranks / (tp * pp * ep * cp)."""
    ep_capacity_factor: float = 2.0
    """ep > 1: each rank sends every EP peer a fixed ``C = ceil(factor * slots / ep)`` rows (rounded up
    to 8; slots = tokens x top_k of the step's largest forward), padded, so the all-to-alls need no
    split sizes on the host and a MoE block has no host sync (workers/trainer/parallel/expert_capacity.py). A step
    in which any rank would send a peer more than C rows is redone with exact dispatch (counted as
    ``ep_overflow_steps``, warned): never a dropped token. 0: exact dispatch always (one host read of
    the split sizes per MoE block and micro-batch). Else >= 1 (below, C cannot hold the average
    peer's rows and every step would be redone). Larger: fewer redos, more padding moved and computed
    (the routed experts' activations grow by the factor: launcher/activations.py)."""

    def resolve(self, num_ranks: int) -> dict[str, int]:
        """``{tp, pp, ep, cp, dp}`` with dp derived; ValueError with the numbers when they do not make num_ranks."""
        for key in ("tp", "pp", "ep", "cp"):
            if getattr(self, key) < 1:
                raise ValueError(f"trainer.parallel.{key} must be >= 1, got {getattr(self, key)}")
        if self.pp != 1:
            raise ValueError(f"trainer.parallel.pp({self.pp}) > 1: the trainer has no pipeline parallelism yet; "
                             f"use tp / ep / dp")
        shard = self.tp * self.pp * self.ep * self.cp
        sizes = f"tp({self.tp}) * pp({self.pp}) * ep({self.ep})" + (f" * cp({self.cp})" if self.cp != 1 else "")
        if self.dp == -1:
            if num_ranks % shard:
                raise ValueError(f"trainer.parallel: {sizes} = {shard} does not divide trainer.num_ranks({num_ranks}), "
                                 f"so dp cannot be derived")
            dp = num_ranks // shard
        else:
            dp = self.dp
            if dp < 1 or shard * dp != num_ranks:
                raise ValueError(f"trainer.parallel: {sizes} * dp({dp}) = {shard * dp} != trainer.num_ranks({num_ranks})")
        return {"tp": self.tp, "pp": self.pp, "ep": self.ep, "cp": self.cp, "dp": dp}


@dataclasses.dataclass(kw_only=True)
class TrainerConfig:
    num_ranks: int = 1
    """Trainer processes (gloo locally, NCCL on GPUs); split tp x pp x ep x dp by trainer.parallel."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout of the trainer ranks."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters instead of full fine-tuning (rank 0, the default: full fine-tuning); workers/common/config/lora.py."""
    num_steps: int = 400
    """Trainer steps of the run; step N (1-based) trains batch N from weights N-1 and publishes weights/step_N."""
    lr: float = 3e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    """AdamW betas."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    dtype: str = "float32"
    """Training compute dtype (forward and backward matmuls; published weights are cast to it)."""
    master_dtype: str = "float32"
    """Master weights and AdamW state (workers/trainer/precision.py): float32 (default; with dtype=bfloat16
    that is mixed precision, gradients reduced in float32) or bfloat16 (pure bf16 state: updates below
    ~2^-9 of a weight round away; only with dtype=bfloat16, and the plan warns)."""
    micro_batch_tokens: int = 0
    """Token budget of one forward/backward on a rank (rows x padded length, or summed lengths when
    pack_sequences): the rank's rows are split into micro-batches and gradients accumulate, the loss
    still normalised by the step's global token count. 0: the whole rank batch in one pass. Must
    hold the longest sample (model.max_position_embeddings tokens)."""
    activation_checkpointing: str = "none"
    """``none`` | ``full`` | ``selective``: recompute each decoder layer's activations in the backward
    instead of keeping them (``full``: all of them, ~1/3 more compute; ``selective``: keep the matmul and
    attention outputs, recompute the elementwise rest; workers/trainer/micro.py)."""
    compile: str = "auto"
    """``none`` | ``layers`` | ``auto``: torch.compile (inductor) of each decoder layer's forward, inside
    activation checkpointing and FSDP's per-layer hooks (workers/trainer/compile.py): fewer, fused kernels
    where the step is launch-bound. ``auto`` (default): ``layers`` on CUDA, ``none`` on the CPU (where
    compiling costs more than it saves for tiny models)."""
    aux_loss_coef: float = 0.0
    """Weight of the MoE load-balancing loss; 0 (default): off. RL on a user's checkpoint must not move
    the router when nothing is rewarded (a balance loss alone, through AdamW, drifts a pretrained MoE's
    logits and its inference/trainer routing within a few steps), so balancing is opt-in (0.001-0.01 is the
    usual range when pretraining-style balancing is wanted)."""
    loss_agg: str = "token_mean"
    """How per-token policy-gradient terms become the loss (workers/trainer/objective.py): ``token_mean``
    (sum over every loss token of the step / their count: long answers weigh more; DAPO),
    ``seq_mean_token_sum`` (each sequence's token sum, mean over sequences; Dr. GRPO without its
    constant) or ``seq_mean_token_mean`` (each sequence's token mean, mean over sequences; GRPO as
    published, GSPO). Normalisers are global over the trainer ranks. The entropy bonus is aggregated the same way."""
    clip_low: float = 0.0
    """PPO clip against the behaviour policy (the inference log-probs): a token whose ratio (at
    ``ratio_level``) is below 1 - clip_low with a negative advantage gives no gradient. 0: no lower clip.
    Usual: 0.2."""
    clip_high: float = 0.0
    """Upper PPO clip: a token whose ratio is above 1 + clip_high with a positive advantage gives no
    gradient. 0: no upper clip. Usual: 0.2 (PPO/GRPO), 0.28 (DAPO clip-higher), 4e-4 with ratio_level=geometric (GSPO)."""
    entropy_coef: float = 0.0
    """Entropy bonus: ``loss -= entropy_coef * H`` (H aggregated like the policy term); 0 (default): off.
    Usual: 0-0.01."""
    kl_coef: float = 0.0
    """Penalty ``kl_coef * KL(pi_train || pi_ref)`` to the step-0 policy, from the reference log-probs the
    orchestrator puts in the batch (``ref_logprobs``); 0 (default): off. Usual: 0.001-0.1."""
    kl_estimator: str = "k3"
    """Per-token KL estimate (Schulman's): ``k1`` = log r, ``k2`` = (log r)^2 / 2, ``k3`` = 1/r - 1 + log r
    with r = pi_train / pi_ref on the sampled token (k3: non-negative, low variance)."""
    ratio_cap: float = 2.0
    """Truncated importance sampling: per-token ratio pi_train/pi_inference is capped here."""
    ratio_mask_low: float = 0.2
    """Tokens whose ratio is below this are masked out of the loss."""
    ratio_mask_high: float = 5.0
    """Tokens whose ratio is above this are masked out of the loss."""
    router_replay: bool = False
    """Router Replay (R3): force the experts inference chose (the batch's routed_experts) in the
    trainer forward; gate weights still come from the trainer's router, so it still learns."""
    replay_unreported: str = "recompute"
    """Router Replay at positions inference did not report (routed_mask 0: prefix-cache hits, the
    last sampled token): ``recompute`` routes them with the trainer's own router; ``mask`` also drops
    from the loss every token predicted from such a position (strict, never trains on a guess)."""
    ratio_level: str = "token"
    """What ratio_cap / ratio_mask_low / ratio_mask_high apply to: ``token`` (each token's own
    ratio: TIS / MIS), ``sequence`` (the product over a row's loss tokens, the exact sequence-level
    IS ratio) or ``geometric`` (its per-token geometric mean, length-normalised as in GSPO). The two
    row levels cap or mask every token of a row together."""
    pack_sequences: bool = False
    """Pack rows into fewer, fuller rows for the forward (attention per sample, no [T, T] mask;
    per-sample positions; routed experts move with their tokens); the loss is computed back in row layout."""
    logprob_chunk_tokens: int = 4096
    """Positions whose lm_head logits and log-softmax are computed at once when scoring (forward and,
    recomputed, backward): peak logit memory is this x vocab, never sequence x vocab
    (workers/models/blocks/logprobs.py). 0: all positions at once (no recompute)."""
    logprob_head: str = "fused_loss"
    """How the scored chunks are computed: ``fused_loss`` (the default: the fused head, and where the
    loss is a sum of per-token terms, i.e. ``ratio_level=token``, no entropy bonus, cp 1, the head takes
    the loss's gradient in its forward: 3 GEMMs over the vocabulary instead of 4; it holds the head
    weight's float32 gradient, 4 x vocab x hidden bytes, from the forward to the backward;
    workers/models/blocks/fused_loss_head.py; elsewhere it is ``fused``), ``fused`` (one autograd
    Function with a closed-form backward: fewer passes over chunk x vocab and one such block alive at a
    time; workers/models/blocks/fused_logprobs.py) or ``checkpoint`` (autograd through the log-softmax
    under activation checkpointing). A vocabulary-parallel head (tp > 1) always takes ``checkpoint``."""
    batch_timeout_s: float = 600.0
    """Deadline for the orchestrator's next batch before the trainer gives up."""
    num_threads: int = 1
    """torch intra-op threads per trainer rank."""
    simulated_step_delay_s: float = 0.0
    """Benchmarks/tests only: sleep this long per step to emulate a large, slow trainer."""
    checkpoint_every_steps: int = 10
    """Write a checkpoint (model, optimizer, RNG, step) after every this many steps; 0: only on
    SIGUSR1/SIGTERM. A restarted trainer resumes from the newest COMPLETE one."""
    num_checkpoints_kept: int = 2
    """Complete checkpoints kept on disk (older ones are deleted after a new one is complete)."""

    def __post_init__(self) -> None:
        # Checked here so a typo fails in the launcher (which builds this dataclass), not on a rank.
        for key, choices in (("ratio_level", ("token", "sequence", "geometric")),
                             ("replay_unreported", ("recompute", "mask")),
                             ("master_dtype", MASTER_DTYPES), ("activation_checkpointing", ACTIVATION_CHECKPOINTING),
                             ("compile", COMPILE), ("logprob_head", LOGPROB_HEADS), ("loss_agg", LOSS_AGG),
                             ("kl_estimator", KL_ESTIMATORS)):
            if getattr(self, key) not in choices:
                raise ConfigError(f"trainer.{key}={getattr(self, key)!r} is not supported; choose one of {list(choices)}")
        if self.checkpoint_every_steps < 0 or self.num_checkpoints_kept < 1:
            raise ConfigError(f"trainer.checkpoint_every_steps({self.checkpoint_every_steps}) must be >= 0 and "
                             f"trainer.num_checkpoints_kept({self.num_checkpoints_kept}) >= 1")


def experts_per_rank(num_experts: int, ep: int, key: str = "trainer.parallel.ep") -> int:
    """Routed experts each of ``ep`` expert-parallel ranks holds: the one check that ``ep`` divides
    ``model.num_experts``, for the trainer (plan time and every rank) and the inference layouts alike;
    ValueError naming ``key`` otherwise."""
    if ep < 1 or num_experts % ep:
        raise ValueError(f"{key}({ep}) must divide model.num_experts({num_experts})")
    return num_experts // ep


def check_precision(dtype: str, master_dtype: str) -> Optional[str]:
    """Plan time (torch-free; the trainer calls it too): ValueError naming the key for a combination the trainer refuses;
    the warning text for pure-bfloat16 state; None when all is well."""
    if master_dtype not in MASTER_DTYPES:
        raise ValueError(f"trainer.master_dtype={master_dtype!r} is not supported; choose one of {list(MASTER_DTYPES)}")
    if master_dtype == "bfloat16" and dtype != "bfloat16":
        raise ValueError(f"trainer.master_dtype=bfloat16 with trainer.dtype={dtype}: master weights cannot be less "
                         f"precise than the compute dtype; use trainer.master_dtype=float32")
    if master_dtype == "bfloat16":
        return ("trainer.master_dtype=bfloat16: weights and AdamW state are pure bfloat16, so updates smaller than "
                "~2^-9 of a weight round away (at lr 1e-6 most weights never change); float32 master weights and "
                "AdamW state (the default) take 16 instead of 8 B/param, sharded over the trainer ranks by FSDP")
    return None


limits(ParallelConfig, tp=gt(0), pp=gt(0), ep=gt(0), cp=between(1, 1024), dp=gt(0, also=(-1,)),
       ep_capacity_factor=Range(lo=1, hi=1024, also=(0,)))  # below 1 every step would overflow
limits(TrainerConfig, num_ranks=gt(0), num_steps=gt(0), lr=gt(0), weight_decay=ge(0),
       betas=Each(between(0, 1, hi_open=True), length=2), grad_clip=gt(0), dtype=one_of(*COMPUTE_DTYPES),
       master_dtype=one_of(*MASTER_DTYPES), micro_batch_tokens=ge(0), logprob_chunk_tokens=between(0, 1 << 20),
       activation_checkpointing=one_of(*ACTIVATION_CHECKPOINTING), compile=one_of(*COMPILE),
       logprob_head=one_of(*LOGPROB_HEADS),
       aux_loss_coef=ge(0), ratio_cap=ge(1), ratio_mask_low=between(0, 1, lo_open=True), ratio_mask_high=ge(1),
       replay_unreported=one_of("recompute", "mask"), ratio_level=one_of("token", "sequence", "geometric"),
       batch_timeout_s=gt(0), num_threads=gt(0), simulated_step_delay_s=ge(0), checkpoint_every_steps=ge(0),
       num_checkpoints_kept=gt(0), loss_agg=one_of(*LOSS_AGG), clip_low=between(0, 1, hi_open=True),
       clip_high=between(0, 10), entropy_coef=between(0, 1), kl_coef=between(0, 10),
       kl_estimator=one_of(*KL_ESTIMATORS))
