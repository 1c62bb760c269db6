"""One optimizer step of the parallel trainer: forward (replay, packing), loss, backward, sync.

The same code runs either plan (``model`` is the FSDP plan's model, workers/trainer/parallel/fsdp.py, or the
tp/ep mesh plan's, workers/trainer/parallel/mesh.py), one micro-batch or several
(``trainer.micro_batch_tokens``, workers/trainer/micro.py: gradients accumulate, the loss keeps
the step's GLOBAL normalisers).

Who talks to whom inside a step (every rank, in the same order; deadlines are the process
group's timeout):
  micro      one all-reduce (max) of the micro-batch count, when micro-batching;
  ep         fixed-capacity EP dispatch (workers/trainer/parallel/expert_capacity.py): one all-reduce (max) over
             all ranks of the largest forward's tokens before the forwards, one of the overflow
             flags after the backwards (then, rarely, the whole forward/backward again, exact);
  forward    per layer: FSDP all-gathers; with tp/ep, DTensor TP all-reduces (attention, MLPs), EP
             all-to-alls (dispatch, combine) and tp token all-gathers in MoE blocks, vocab-parallel
             all-reduces for the log-probs,
             context-parallel all-to-alls around attention / Mamba (workers/trainer/parallel/context.py);
  counts     one all-reduce over ``batch`` of token and expert counts (global normalisers;
             with several micro-batches and a balance loss, after a no-grad counting forward);
  backward   the same collectives mirrored (FSDP: reduce-scatter of each layer's gradients);
  grads      done by FSDP's reduce-scatters (mesh plan: dense over ``batch``, experts over the
             expert-data-parallel ranks); the norm: one all-reduce of a scalar;
  stats      two all-reduces over ``batch`` (sums, then extremes).
Every quantity is computed in ROW layout ``[B, T]`` whether or not the forward was packed.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Optional

import torch

from workers.common.config import TrainerConfig
from workers.models.blocks.logprobs import Scoring
from workers.trainer import head_loss
from workers.trainer.parallel import context
from workers.trainer.batch import RolloutBatch
from workers.trainer.loss import (TokenStats, disagreement_counts, expert_counts, load_balance_loss,
                                  loss_relevant_inputs, policy_loss_terms)
from workers.trainer.parallel.expert_capacity import StepCapacity
from workers.trainer.micro import split_micro_batches
from workers.trainer.objective import aggregation
from workers.trainer.packing import plan_packing
from workers.trainer.parallel.dims import ParallelDims
from workers.trainer.router_replay import expert_load_metrics, mask_unreported, replay_inputs
from workers.trainer.routing_capture import capture_routing, stack_own
from workers.trainer.parallel.fsdp import FsdpTrainerModel, accumulate_unsharded
from workers.models.lora.rows import rows_of


@dataclasses.dataclass
class RowForward:
    """What the loss and the metrics need from one forward, in row layout."""

    logp: torch.Tensor  # [B, T] log p(token t), with grad; column 0 zero
    entropy: torch.Tensor  # [B, T] entropy of the distribution of token t (no grad)
    routed: torch.Tensor  # [B, T, L, k] experts used (the forced ones under replay)
    own: torch.Tensor  # [B, T, L, k] the trainer router's own top-k
    prob_sums: torch.Tensor  # [L, E] router probability sums over valid tokens (with grad)
    counts: torch.Tensor  # [L, E] routed slots per expert over valid tokens (this rank)
    head_loss: Optional[torch.Tensor] = None  # the policy loss, when the head took it (logp then has no grad)


def forward_rows(model: FsdpTrainerModel, batch: RolloutBatch, *, replay: bool, pack: bool,
                 logprob_chunk: int = 0, fused_head: bool = True, entropy_grad: bool = False,
                 loss_terms: Optional[Callable] = None) -> RowForward:
    """Forward ``batch`` (replaying its routing if asked, packed if asked) and score its tokens,
    ``logprob_chunk`` positions at a time (``trainer.logprob_chunk_tokens``; 0: all at once), with the
    fused head when ``fused_head`` (``trainer.logprob_head=fused``); ``entropy_grad``: the entropy keeps
    its gradient (an entropy bonus: the checkpointed head, whose entropy carries one). ``loss_terms``
    (workers/trainer/head_loss.py ``token_loss``, with the fused head, not under context parallelism):
    the head takes the loss's gradient in its forward and ``RowForward.head_loss`` is the loss."""
    cfg = model.config
    forced, forced_mask = replay_inputs(batch.routed_experts, batch.routed_mask, enabled=replay)
    ids, attention, positions, segments, packing = batch.input_ids, batch.attention_mask, None, None, None
    pack = pack and bool(batch.attention_mask.any())  # a padding micro-batch has nothing to pack
    if pack:
        packing = plan_packing(attention)
        ids, attention = packing.pack(ids), packing.attention_mask
        positions, segments = packing.position_ids, packing.segment_ids
        if forced is not None:
            forced, forced_mask = packing.pack(forced), packing.pack(forced_mask, False)
    need = loss_relevant_inputs(batch.loss_mask)  # logits that predict a loss token: the only ones scored
    if packing is not None:
        need = packing.pack(need, False)
    inputs = dict(input_ids=ids, position_ids=positions, attention_mask=attention, forced_experts=forced,
                  forced_mask=forced_mask, segment_ids=segments, logits_mask=need)
    cp = context.split(model, inputs)  # None at cp 1; else this rank's chunk of the rows
    if cp is not None:
        inputs, ids, need = cp.inputs, cp.ids, cp.need  # ids/need: the whole (padded) rows, for the targets
    at = predicted(need)  # the scored positions' targets, in the order of the (chunk's) logits_mask
    fused = fused_head and not entropy_grad
    token_loss = None
    if loss_terms is not None and fused and cp is None:
        token_loss = loss_terms(lambda x: (x if packing is None else packing.pack(x))[at])
    inputs = {**inputs, "score": Scoring(targets=ids[at], chunk_tokens=logprob_chunk,
                                         scorer=lambda z, y: model.target_logprobs(z, y, batch.temperature,
                                                                                        entropy_grad),
                                         fused_temperature=batch.temperature if fused else None,
                                         token_loss=token_loss)}
    rows = rows_of(model)
    if rows is not None:  # several LoRA adapters: each token's adapter, in the forward's layout (models/lora/rows.py)
        if batch.adapter_ids is None:
            raise ValueError(f"trainer.lora.adapters={list(rows.names)}: the batch has no adapter_ids")
        tok = batch.adapter_ids[:, None].expand(batch.input_ids.shape)
        rows.use(tok if packing is None else packing.pack(tok))
    with compute_context(model), capture_routing(model, valid=inputs["attention_mask"]) as routers:
        out = model(**inputs)
    logp, entropy = place(at, out.logp), place(at, out.entropy)
    prob_sums, counts = torch.zeros(0, 0, device=ids.device), torch.zeros(0, 0, device=ids.device)  # dense
    if routers:
        prob_sums = torch.stack([p for p, _ in routers])
        counts = expert_counts(out.routed_experts, inputs["attention_mask"], cfg.num_experts)
    own, routed = stack_own(routers, tuple(out.routed_experts.shape[:2]), ids.device), out.routed_experts
    if cp is not None:  # back to the whole rows, zeros at the other cp ranks' tokens
        logp, entropy, own, routed = cp.whole(logp, entropy, own, routed)
    if packing is not None:
        logp, entropy = packing.unpack_shifted(logp), packing.unpack_shifted(entropy)
        own, routed = packing.unpack(own), packing.unpack(routed)
    return RowForward(logp=logp, entropy=entropy, routed=routed, own=own, prob_sums=prob_sums, counts=counts,
                      head_loss=out.head_loss)


def scatter_logprobs(model: FsdpTrainerModel, logits: torch.Tensor, ids: torch.Tensor, need: torch.Tensor,
                     temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` log p(token t) and entropy from logits computed only at ``need`` (position t-1
    predicts token t), zero elsewhere: the layout of ``loss.token_logprobs``."""
    at = predicted(need)
    logp, entropy = model.target_logprobs(logits, ids[at], temperature)
    return place(at, logp), place(at, entropy)


def predicted(need: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: the positions of the tokens that the ``need`` positions predict (one later)."""
    return torch.cat([torch.zeros_like(need[:, :1]), need[:, :-1]], dim=1)


def place(at: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values [N]`` into a [B, T] zero tensor at the ``at`` positions, row-major."""
    return torch.zeros(at.shape, dtype=values.dtype, device=values.device).masked_scatter(at, values)


def backward_step(model: FsdpTrainerModel, shard: RolloutBatch, tcfg: TrainerConfig,
                  dims: ParallelDims) -> dict[str, float]:
    """Forward, loss with GLOBAL normalisers, backward (per micro-batch, gradients accumulating),
    gradient sync and clip (no optimizer step).

    Returns the step's global statistics. Split from :func:`train_step` so the parity test
    can compare the synced gradients of any layout with a one-process reference. With one
    micro-batch the balance loss takes its global expert counts from the training forward
    itself; with several (workers/trainer/micro.py) every micro-batch's balance loss needs the
    counts of them all first, so a no-grad forward over the micro-batches counts them (only
    when the model routes and trainer.aux_loss_coef > 0; its cost is one forward).
    """
    mcfg = model.config
    replay = tcfg.router_replay and shard.routed_experts is not None
    model.train()
    token_weight, norm = aggregation(shard.loss_mask, tcfg.loss_agg)  # on whole rows (workers/trainer/objective.py)
    shard = dataclasses.replace(shard, token_weight=token_weight)
    micro = split_micro_batches(shard, tcfg.micro_batch_tokens, packed=tcfg.pack_sequences, dims=dims)
    tokens = torch.stack([norm, shard.attention_mask.sum().to(torch.float64)])  # no host sync
    if dims.cp > 1:  # each cp rank scores its own chunk of the same rows (workers/trainer/parallel/context.py)
        micro, chunk_tokens = context.own_chunks(micro, dims)
        # token_mean: each rank's own loss tokens; per-row modes: every cp rank holds the same rows
        tokens = chunk_tokens if tcfg.loss_agg == "token_mean" else torch.stack([norm / dims.cp, chunk_tokens[1]])
    cap = StepCapacity.begin(model, [mb.input_ids for mb in micro], dims)  # None unless fixed-capacity EP

    def run() -> tuple[_Accumulator, torch.Tensor | None, float]:
        return _forward_backward(model, micro, tokens.clone(), tcfg, dims, replay=replay)
    try:
        acc, counts, num_valid = run()
        if cap is not None and cap.overflowed():  # the step's one read of the EP overflow flags
            acc, counts, num_valid = cap.redo_exact(run)
    finally:
        if cap is not None:
            cap.end()
    if counts is None:  # several micro-batches, no balance gradient: the counts are still a metric
        counts = dims.all_reduce(acc.counts) if acc.counts.numel() else acc.counts
    model.sync_grads()
    grad_norm = model.clip_grad_norm_(tcfg.grad_clip if tcfg.grad_clip > 0 else float("inf"))
    # The balance loss is linear in prob_sums (its routed fractions are detached): the sum of the
    # micro-batches' detached sums gives its value exactly.
    aux_loss = (load_balance_loss(acc.prob_sums, counts, num_valid, mcfg.top_k).detach()
                if acc.prob_sums is not None else torch.zeros((), device=dims.device))
    stats = reduce_stats(dims, acc.sums(aux_loss, routed=shard.routed_experts is not None), acc.ext,
                         aux_coef=tcfg.aux_loss_coef, grad_norm=grad_norm)
    stats.update(expert_load_metrics(counts))
    if cap is not None:
        stats["ep_overflow_steps"] = model.ep_overflow_steps
    return stats


def _forward_backward(model: FsdpTrainerModel, micro: list[RolloutBatch], tokens: torch.Tensor, tcfg: TrainerConfig,
                      dims: ParallelDims, *, replay: bool) -> tuple["_Accumulator", torch.Tensor | None, float]:
    """Every micro-batch's forward, loss and backward from zero gradients: (sums, the global expert
    counts when the balance loss needed them, the global valid-token count)."""
    mcfg = model.config
    for p in model.parameters():
        p.grad = None
    counts = None
    chunk, ent = tcfg.logprob_chunk_tokens, tcfg.entropy_coef > 0
    fused = tcfg.logprob_head in ("fused", "fused_loss")
    one_pass = head_loss.applies(tcfg, dims.cp)
    if one_pass:  # the normalisers before the forward: the head takes the loss's gradient in it
        num_loss_tokens, num_valid = dims.all_reduce(tokens).tolist()

    def loss_mask_of(mb: RolloutBatch) -> torch.Tensor:
        if replay and tcfg.replay_unreported == "mask":
            return mask_unreported(mb.loss_mask, mb.routed_mask)
        return mb.loss_mask

    def forward(mb: RolloutBatch) -> RowForward:
        terms = head_loss.token_loss(mb, loss_mask_of(mb), tcfg, num_loss_tokens) if one_pass else None
        return forward_rows(model, mb, replay=replay, pack=tcfg.pack_sequences, logprob_chunk=chunk,
                            fused_head=fused, entropy_grad=ent, loss_terms=terms)

    if len(micro) == 1:
        fwd = forward(micro[0])
        if one_pass:
            counts = dims.all_reduce(fwd.counts.flatten().double()).view(fwd.counts.shape)
        else:
            totals = dims.all_reduce(torch.cat([tokens, fwd.counts.flatten().double()]))
            counts = totals[2:].view(fwd.counts.shape)
        fwds = [fwd]
    else:
        if not one_pass:
            totals = dims.all_reduce(tokens)
        if mcfg.num_routed_layers and tcfg.aux_loss_coef > 0:
            counts = dims.all_reduce(count_experts(model, micro, replay=replay, pack=tcfg.pack_sequences))
        fwds = [None] * len(micro)
    if not one_pass:
        num_loss_tokens, num_valid = totals[:2].tolist()  # the step's one sync before the backward
    acc = _Accumulator(dims.device)
    for i, mb in enumerate(micro):
        fwd = fwds[i] or forward(mb)
        fwds[i] = None  # drop the graph's owner as soon as it is used
        loss_mask = loss_mask_of(mb)
        pg_loss, tok = policy_loss_terms(fwd.logp, mb.inference_logprobs, mb.advantages, loss_mask,
                                         num_loss_tokens=num_loss_tokens, entropy=fwd.entropy,
                                         token_weight=mb.token_weight,
                                         entropy_coef=0.0 if fwd.head_loss is not None else tcfg.entropy_coef,
                                         ref_logprobs=mb.ref_logprobs, **head_loss.loss_kwargs(tcfg))
        if fwd.head_loss is not None:  # the head took the loss (and its gradient): the terms above are statistics
            pg_loss = fwd.head_loss
        loss = pg_loss
        if counts is not None and tcfg.aux_loss_coef > 0:
            loss = loss + tcfg.aux_loss_coef * load_balance_loss(fwd.prob_sums, counts, num_valid, mcfg.top_k)
        if len(micro) > 1:
            accumulate_unsharded(model, last=i == len(micro) - 1)
        loss.backward()
        acc.add(mb, fwd, tok, pg_loss=pg_loss.detach(), unreported=(mb.loss_mask & ~loss_mask).sum())
    return acc, counts, num_valid


@torch.no_grad()
def count_experts(model: FsdpTrainerModel, micro: list[RolloutBatch], *, replay: bool, pack: bool) -> torch.Tensor:
    """``[L, E]`` float64 routed slots per expert over this rank's micro-batches (no graph kept)."""
    total = None
    for mb in micro:
        counts = forward_rows(model, mb, replay=replay, pack=pack).counts.double()
        total = counts if total is None else total + counts
    return total


class _Accumulator:
    """Per-rank sums over the micro-batches of what the statistics need, kept ON THE DEVICE: nothing
    here syncs with the host (a ``.item()`` per micro-batch stalls the GPU queue each time); the step
    reads them all at once in :func:`reduce_stats`."""

    def __init__(self, device: torch.device):
        self.vec = torch.zeros(len(TokenStats.SUM_FIELDS) + 4, dtype=torch.float64, device=device)
        """TokenStats.SUM_FIELDS, then pg_loss, unreported, disagree, slots."""
        self.ext = torch.full((2,), float("-inf"), dtype=torch.float64, device=device)
        """ratio_max, -ratio_min."""
        self.prob_sums: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    def add(self, mb: RolloutBatch, fwd: RowForward, tok: torch.Tensor, *, pg_loss: torch.Tensor,
            unreported: torch.Tensor) -> None:
        n = len(TokenStats.SUM_FIELDS)
        disagree = torch.zeros(2, dtype=torch.float64, device=self.vec.device)
        if mb.routed_experts is not None:
            slots = loss_relevant_inputs(mb.loss_mask) & mb.routed_mask
            disagree = disagreement_counts(fwd.own, mb.routed_experts, slots)
        self.vec += torch.cat([tok[:n], pg_loss.double().reshape(1), unreported.double().reshape(1), disagree])
        self.ext = torch.maximum(self.ext, torch.stack([tok[n], -tok[n + 1]]))
        ps, c = fwd.prob_sums.detach().double(), fwd.counts.double()
        self.prob_sums = ps if self.prob_sums is None else self.prob_sums + ps
        self.counts = c if self.counts is None else self.counts + c

    def sums(self, aux_loss: torch.Tensor, *, routed: bool) -> dict[str, torch.Tensor]:
        """Name -> 0-d tensor of this rank's sums (disagreement only when the batch reports routing)."""
        names = TokenStats.SUM_FIELDS + ("pg_loss", "unreported", "disagree", "slots")
        out = dict(zip(names, self.vec.unbind()))
        if not routed:
            del out["disagree"], out["slots"]
        out["aux_loss"] = aux_loss.double().reshape(())
        return out


def train_step(model: FsdpTrainerModel, optimizer: torch.optim.Optimizer, shard: RolloutBatch,
               tcfg: TrainerConfig, dims: ParallelDims) -> dict[str, float]:
    """One optimizer step on this rank's rows; returns GLOBAL statistics. Every rank ends with
    the same dense weights as its ``batch`` peers and the same experts as its ``dp`` peers."""
    stats = backward_step(model, shard, tcfg, dims)
    optimizer.step()
    return stats


def reduce_stats(dims: ParallelDims, sums: dict[str, torch.Tensor], extremes: torch.Tensor, *, aux_coef: float,
                 grad_norm: float) -> dict[str, float]:
    """All-reduce per-rank sums (name -> 0-d tensor) and extremes (``[ratio_max, -ratio_min]``) over
    ``batch`` and turn them into global means: the step's statistics reach the host here, in ONE copy."""
    names = sorted(sums)
    summed = dims.all_reduce(torch.stack([sums[k] for k in names]))
    ext = dims.all_reduce(extremes.clone(), op="max")
    values = torch.cat([summed, ext]).tolist()
    g = dict(zip(names, values[:len(names)]))
    ext = values[len(names):]
    n = g["num_tokens"]
    per_token = (lambda x: x / n) if n else (lambda x: float("nan"))
    stats = {
        "loss": g["pg_loss"] + aux_coef * g["aux_loss"],
        "pg_loss": g["pg_loss"],
        "aux_loss": g["aux_loss"],
        "grad_norm": grad_norm,
        "entropy": per_token(g["entropy_sum"]),
        "mismatch_kl": per_token(g["k3_sum"]),
        "ratio_mean": per_token(g["ratio_sum"]),
        "ratio_max": ext[0],
        "ratio_min": -ext[1],
        "ratio_masked_frac": per_token(g["num_masked"]),
        "ratio_capped_frac": per_token(g["num_capped"]),
        "clip_frac": per_token(g["num_clipped"]),
        "num_loss_tokens": int(n),
    }
    if g["ref_kl_sum"]:
        stats["ref_kl"] = per_token(g["ref_kl_sum"])
    if g["unreported"]:
        stats["replay_unreported_tokens"] = int(g["unreported"])
    if "slots" in g:
        stats["routing_disagreement"] = g["disagree"] / g["slots"] if g["slots"] else float("nan")
    return stats


def compute_context(model):
    """The plan's forward context (mixed precision: workers/trainer/precision.py); none for a bare model."""
    compute = getattr(model, "compute", None)
    return compute() if compute is not None else contextlib.nullcontext()
