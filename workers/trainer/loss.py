"""Loss math of the trainer: pure tensor functions, no process group, no I/O (unit-tested).

Data parallelism is handled by *how the functions are called*, not inside them: every
normaliser (``num_loss_tokens``, ``num_valid_tokens``, expert ``counts``) is passed in as a
GLOBAL value (summed over all trainer ranks before the backward). Each rank's loss is then
exactly its shard's share of the one-rank loss, so summing gradients over ranks gives the
gradient a single rank would compute on the whole batch. Statistics are returned as
*sums* (:class:`TokenStats`) for the same reason: the loop all-reduces them, then divides.

Shapes: ``B`` rows, ``T`` positions, ``V`` vocab, ``L`` MoE layers, ``k`` experts per token,
``E`` experts. Token ``t`` is predicted from the logits at ``t - 1`` (protocol.py), so
position 0 never carries a log-prob.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.nn.functional as F

from workers.trainer.objective import clipped, kl_estimate

#: exp() of a log-ratio beyond this overflows float32 statistics; ratios that far out are
#: masked anyway (ratio_mask_high is ~5), the clamp only keeps k3/ratio sums finite.
MAX_ABS_LOG_RATIO = 20.0


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-prob of ``input_ids`` and entropy, both ``[B, T]``, column 0 zero.

    The logits are divided by the sampling ``temperature`` so the trainer scores the very
    distribution inference sampled from. log_softmax runs in at least float32 (bf16 logits
    would otherwise put ~1e-2 noise into the importance ratios).
    """
    assert temperature > 0, f"temperature must be > 0, got {temperature}"
    work = torch.promote_types(logits.dtype, torch.float32)
    logp_all = F.log_softmax(logits[:, :-1].to(work) / temperature, dim=-1)  # [B, T-1, V]
    logp = logp_all.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    with torch.no_grad():  # a metric only: keep it out of the autograd graph
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    pad = logp.new_zeros(logp.shape[0], 1)
    return torch.cat([pad, logp], dim=1), torch.cat([pad.detach(), entropy], dim=1)


@dataclasses.dataclass
class TokenStats:
    """Sums over this rank's loss tokens (all-reduce with SUM, except the max/min fields)."""

    num_tokens: float
    """Loss tokens (loss_mask) on this rank."""
    num_masked: float
    """Loss tokens dropped because their ratio was outside [ratio_mask_low, ratio_mask_high]."""
    num_capped: float
    """Kept tokens whose IS weight was truncated at ratio_cap."""
    ratio_sum: float
    k3_sum: float
    """Sum of k3 = r - log r - 1 (an unbiased, non-negative KL(inference || trainer) estimate)."""
    entropy_sum: float
    num_clipped: float
    """Kept tokens without gradient because PPO's clipped branch was taken (trainer.clip_low/high)."""
    ref_kl_sum: float
    """Sum of the trainer.kl_estimator KL(trainer || reference) over kept tokens (0 without reference)."""
    ratio_max: float
    ratio_min: float

    SUM_FIELDS = ("num_tokens", "num_masked", "num_capped", "ratio_sum", "k3_sum", "entropy_sum", "num_clipped",
                  "ref_kl_sum")
    FIELDS = SUM_FIELDS + ("ratio_max", "ratio_min")

    @classmethod
    def from_vector(cls, vec: torch.Tensor) -> "TokenStats":
        """From :func:`token_stat_vector`'s ``[10]`` tensor (one host sync)."""
        return cls(**dict(zip(cls.FIELDS, vec.tolist())))


def policy_loss(*args, **kwargs) -> tuple[torch.Tensor, TokenStats]:
    """:func:`policy_loss_terms` with its statistics as a :class:`TokenStats` of floats (one host sync)."""
    pg_loss, vec = policy_loss_terms(*args, **kwargs)
    return pg_loss, TokenStats.from_vector(vec)


def policy_loss_terms(
    logp_train: torch.Tensor,
    logp_inference: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    num_loss_tokens: float,
    ratio_cap: float,
    ratio_mask_low: float,
    ratio_mask_high: float,
    entropy: torch.Tensor | None = None,
    ratio_level: str = "token",
    token_weight: torch.Tensor | None = None,
    clip_low: float = 0.0,
    clip_high: float = 0.0,
    entropy_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Policy gradient with truncated importance sampling and ratio masking; returns the loss and
    the :class:`TokenStats` sums as a device tensor (:func:`token_stat_vector`: no host sync).

    r = exp(logp_train - logp_inference) corrects for the trainer/inference mismatch (other
    kernels, dtype, and stale policy versions in async mode). Tokens with r outside
    [low, high] are dropped (they mark a broken sample, not a small mismatch); the kept
    ones are weighted by w = min(r, cap), detached, so the gradient is w * A * grad logp:

        pg_loss = -sum_kept(w * A * logp_train) / num_loss_tokens

    ``num_loss_tokens`` is the GLOBAL normaliser (workers/trainer/objective.py ``aggregation``:
    the loss tokens *before* ratio masking under ``token_mean``, so masking a token removes its
    contribution without re-weighting the others, and every DP rank divides by the same number;
    the rows under the sequence modes, with ``token_weight`` 1/row-length for ``seq_mean_token_mean``).
    ``advantages`` is per row ``[B]`` or per token ``[B, T]``.

    ``ratio_level`` picks the r that the cap, the mask and the clip see (row = one sequence):
    ``token`` each token's own; ``sequence`` prod_t r_t over the row's loss tokens (the exact
    IS ratio of the sequence: unbiased, but its variance grows with length); ``geometric``
    exp(mean_t log r_t) (length-normalised, GSPO). At the two row levels a row is kept or masked,
    and capped, as a whole. Statistics (ratio_*, k3) stay per token.

    ``clip_low`` / ``clip_high`` (0: off) drop the gradient of kept tokens where PPO's clipped
    branch is taken (objective.clipped). ``entropy_coef`` > 0 subtracts the aggregated entropy
    (``entropy`` must then carry a gradient); ``kl_coef`` > 0 with ``ref_logprobs`` adds the
    aggregated ``kl_estimator`` KL to the reference. Both over the kept tokens, aggregated like
    the policy term; the returned loss is their sum.
    """
    mask = loss_mask.bool()
    log_ratio = (logp_train.detach() - logp_inference).clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO)
    log_ratio = torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
    ratio = log_ratio.exp()
    level = _level_ratio(log_ratio, mask, ratio_level)
    keep = mask & (level >= ratio_mask_low) & (level <= ratio_mask_high)
    weight = level.clamp(max=ratio_cap)
    adv = (advantages[:, None] if advantages.dim() == 1 else advantages).to(logp_train.dtype)
    clip = keep & clipped(level, adv.expand_as(level), clip_low, clip_high)
    per_token = weight * adv * logp_train
    if token_weight is not None:
        per_token = per_token * token_weight
    zero = torch.zeros_like(per_token)
    norm = max(float(num_loss_tokens), 1.0)
    pg_loss = -torch.where(keep & ~clip, per_token, zero).sum() / norm
    scale = token_weight if token_weight is not None else 1.0
    if entropy_coef > 0:
        assert entropy is not None and entropy.requires_grad, "an entropy bonus needs the entropy with its gradient"
        pg_loss = pg_loss - entropy_coef * torch.where(keep, entropy * scale, zero).sum() / norm
    ref_kl = None
    if ref_logprobs is not None:
        ref_kl = kl_estimate(logp_train, ref_logprobs, kl_estimator)
        if kl_coef > 0:
            pg_loss = pg_loss + kl_coef * torch.where(keep, ref_kl * scale, zero).sum() / norm
    return pg_loss, token_stat_vector(log_ratio, ratio, mask, keep, level, ratio_cap, entropy, clip=clip,
                                      ref_kl=ref_kl)


def token_stat_vector(log_ratio: torch.Tensor, ratio: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor,
                      level: torch.Tensor, ratio_cap: float, entropy: torch.Tensor | None, *,
                      clip: torch.Tensor | None = None, ref_kl: torch.Tensor | None = None) -> torch.Tensor:
    """:class:`TokenStats` as one float64 ``[10]`` tensor on the device (``TokenStats.FIELDS`` order), with no
    host sync: the trainer step adds the micro-batches' vectors and reads them once per step."""
    # float64: for near-identical policies k3 ~ d^2/2 ~ 1e-14 cancels to exactly 0 in float32.
    lr64 = log_ratio.double()
    k3 = torch.expm1(lr64) - lr64  # = r - log r - 1; 0 where mask is False (ratio 1, log 0)
    zero = torch.zeros((), dtype=torch.float64, device=mask.device)
    r64 = ratio.double()
    return torch.stack([
        mask.sum().double(), (mask & ~keep).sum().double(), (keep & (level > ratio_cap)).sum().double(),
        torch.where(mask, r64, zero).sum(), torch.where(mask, k3, zero).sum(),
        torch.where(mask, entropy.detach().double(), zero).sum() if entropy is not None else zero,
        clip.sum().double() if clip is not None else zero,
        torch.where(keep, ref_kl.detach().double(), zero).sum() if ref_kl is not None else zero,
        torch.where(mask, r64, float("-inf")).amax() if mask.numel() else zero - float("inf"),
        torch.where(mask, r64, float("inf")).amin() if mask.numel() else zero + float("inf"),
    ])


def _level_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """``[B, T]`` ratio at ``level`` (see policy_loss); ``log_ratio`` is 0 outside ``mask``."""
    if level == "token":
        return log_ratio.exp()
    if level not in ("sequence", "geometric"):
        raise ValueError(f"ratio_level={level!r}: choose token | sequence | geometric")
    row = log_ratio.sum(1)
    if level == "geometric":
        row = row / mask.sum(1).clamp_min(1)
    return row.clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO).exp()[:, None].expand_as(log_ratio)


def load_balance_loss(prob_sums: torch.Tensor, counts: torch.Tensor, num_valid_tokens: float, top_k: int) -> torch.Tensor:
    """This rank's share of the Switch-Transformer balance loss, mean over layers.

    The model computes, per layer, ``E * sum_e f_e * P_e`` with f_e the (detached) fraction
    of routed slots that went to expert e and P_e the mean router probability, both over
    valid tokens. Here ``counts [L, E]`` (routed slots per expert) and ``num_valid_tokens``
    are GLOBAL, ``prob_sums [L, E]`` is this rank's sum of router probabilities over its
    valid tokens. Because f is detached, the loss is linear in prob_sums: summed over
    ranks it equals the one-rank loss, value and gradient alike. With one rank it is the
    model's own ``ModelOutput.aux_loss``.
    """
    num_layers, num_experts = prob_sums.shape
    if num_layers == 0:  # a dense model: nothing to balance
        return prob_sums.new_zeros(())
    n = max(float(num_valid_tokens), 1.0)
    frac = counts.to(prob_sums.dtype).detach() / (n * top_k)
    return num_experts * (frac * prob_sums / n).sum() / num_layers


def router_stats(gate_logits: Sequence[torch.Tensor], routed: torch.Tensor, valid: torch.Tensor,
                 num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``prob_sums [L, E]`` (with grad) and ``counts [L, E]`` (float, detached) for one rank.

    ``gate_logits[l]`` is layer l's softmax-router output ``[B*T, E]``; ``routed [B, T, L, k]`` the
    experts actually used (the forced ones under Router Replay, as in the model's own loss).
    No gate logits (a dense model): both ``[0, 0]``.
    """
    return prob_stats([F.softmax(g.float(), dim=-1) for g in gate_logits], routed, valid, num_experts)


def prob_stats(probs: Sequence[torch.Tensor], routed: torch.Tensor, valid: torch.Tensor,
               num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`router_stats` from each routed layer's router probabilities ``[B*T, E]`` (any router:
    softmax, or the sigmoid router's normalised scores), as ``route`` returns them."""
    if not probs:
        empty = torch.zeros(0, 0, device=valid.device)
        return empty, empty
    v = valid.reshape(-1).to(torch.float32)
    prob_sums = torch.stack([(p.float() * v[:, None]).sum(0) for p in probs])
    return prob_sums, expert_counts(routed, valid, num_experts)


def expert_counts(routed: torch.Tensor, valid: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[L, E]`` routed slots per expert over the valid tokens of ``routed`` ``[B, T, L, k]`` (no grad)."""
    # counts[l, e] = valid (token, slot) pairs routed to e in layer l, by scatter-add: never a one-hot
    # [B, T, L, k, E] (97 GB for one 131k-token row of a GLM-5-shaped model)
    b, t, layers, k = routed.shape
    per_layer = routed.long().permute(2, 0, 1, 3).reshape(layers, b * t * k)  # [L, B*T*k]
    weight = valid.to(torch.float32)[:, :, None].expand(b, t, k).reshape(1, -1).expand(layers, -1)
    counts = torch.zeros(layers, num_experts, device=routed.device).scatter_add_(1, per_layer, weight)
    return counts.detach()


def own_topk(gate_logits: Sequence[torch.Tensor], top_k: int, shape: tuple[int, int],
             device: torch.device | None = None) -> torch.Tensor:
    """The experts this model's router would pick at every layer: ``[B, T, L, k]``.

    Same rule as ``MoeBlock.route`` (top-k of softmax probabilities). Under Router Replay
    the inputs of layer l come from the replayed layers below, so this measures per-layer
    disagreement given identical inputs, not disagreement compounded across layers.
    """
    b, t = shape
    if not gate_logits:  # a dense model: [B, T, 0, 0], like its forward's routed_experts
        return torch.zeros(b, t, 0, 0, dtype=torch.long, device=device)
    picks = [F.softmax(g.detach().float(), dim=-1).topk(top_k, dim=-1).indices.view(b, t, top_k) for g in gate_logits]
    return torch.stack(picks, dim=2)


def routing_disagreement(own: torch.Tensor, reference: torch.Tensor, slot_mask: torch.Tensor) -> tuple[float, float]:
    """(disagreeing slots, slots): a slot is one (token, layer) whose expert SET differs.

    Sets, not ordered lists: engines may report the k experts in any order. ``slot_mask
    [B, T]`` selects the tokens to compare (loss-relevant and reported by inference).
    """
    d, n = disagreement_counts(own, reference, slot_mask).tolist()
    return d, n


def disagreement_counts(own: torch.Tensor, reference: torch.Tensor, slot_mask: torch.Tensor) -> torch.Tensor:
    """:func:`routing_disagreement` as a float64 ``[2]`` tensor on the device (no host sync)."""
    a = own.long().sort(dim=-1).values
    b = reference.long().sort(dim=-1).values
    differs = (a != b).any(dim=-1)  # [B, T, L]
    m = slot_mask.bool()[:, :, None].expand_as(differs)
    return torch.stack([(differs & m).sum(), m.sum()]).double()


def loss_relevant_inputs(loss_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool: positions whose output directly predicts a loss token (t-1 for t).

    These are the slots ``routing_disagreement`` compares. (Earlier positions still reach
    the loss through attention; the last sampled token, whose routing engines do not
    report, predicts nothing that is trained.)
    """
    m = loss_mask.bool()
    return torch.cat([m[:, 1:], torch.zeros_like(m[:, :1])], dim=1)
