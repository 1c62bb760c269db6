"""Context parallelism in the trainer step (``trainer.parallel.cp``): one long sequence over cp ranks.

Layout (workers/trainer/parallel.py): the cp ranks of a group hold the SAME rows (``batch_rank``
ignores cp); each runs the model on a contiguous chunk of every row, ``t = ceil(T / cp)``
positions (rank r: ``[r*t, (r+1)*t)``; a micro-batch is right-padded with invalid tokens to
``cp * t``). Per-token work (embeddings, norms, MLPs, experts, Router Replay, the head, the
log-probs) runs on the chunk only; attention and Mamba-2 see the whole sequence for 1/cp of
their heads through Ulysses all-to-alls (workers/models/blocks/ulysses.py). Rotary positions are
the tokens' global positions (the packed per-sample ones under ``pack_sequences``).

Who scores which token: the logits at position p predict token p+1, so rank r scores the tokens
``[r*t + 1, (r+1)*t]`` (:func:`own_chunks` narrows each micro-batch's ``loss_mask`` to them). No
log-prob crosses ranks: the logits at a chunk's last position predict the next chunk's first token
ON THIS RANK. Everything the step computes stays in ROW layout ``[B, T]`` (zeros outside the
rank's tokens), so the loss, Router Replay's masks (``mask_unreported`` reads position t-1 of the
full row) and the routing-disagreement slots are the same functions as at cp = 1; each rank's
loss is the sum over ITS tokens with the step's GLOBAL normalisers, the token and expert counts
are summed over every rank (the ``batch`` group includes cp), and FSDP's gradient reduce-scatter
over all ranks adds the cp ranks' shares: the result equals cp = 1 (tests/integration/
test_context_parallel.py). A row-level ratio (``ratio_level`` sequence / geometric) would need
the whole row on one rank: the plan refuses it with cp > 1 (launcher/resources.py), as it refuses
cp with tp/ep, a cp that does not divide the heads, and a sequence cp does not divide.

Collectives added per step (every rank of a cp group, same order): per attention / Mamba layer two
all-to-alls forward (q, k, v in; the output back) and the same mirrored in the backward; per DSA
indexer layer two all-gathers (keys, chosen indices), no gradient.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from workers.models.blocks.ulysses import SeqShard
from workers.trainer import step as _step  # this module extends the step; attributes are read at call time
from workers.trainer.batch import RolloutBatch
from workers.trainer.loss import prob_stats
from workers.trainer.parallel import ParallelDims


def chunk_len(width: int, cp: int) -> int:
    """Positions per rank for a micro-batch ``width`` tokens wide (padded up to a multiple of cp)."""
    return -(-width // cp)


def own_chunks(micro: list[RolloutBatch], dims: ParallelDims) -> tuple[list[RolloutBatch], torch.Tensor]:
    """Each micro-batch with ``loss_mask`` narrowed to the tokens this rank scores, and this rank's
    ``[loss tokens, valid positions]`` (float64) whose sums over all ranks are the step's normalisers."""
    out, loss_tokens, valid = [], 0, 0
    for mb in micro:
        width = mb.input_ids.shape[1]
        t = chunk_len(width, dims.cp)
        lo = dims.cp_rank * t
        cols = torch.arange(width, device=mb.input_ids.device)
        scored = (cols > lo) & (cols <= lo + t)  # tokens predicted from this rank's positions
        mine = (cols >= lo) & (cols < lo + t)
        loss_mask = mb.loss_mask & scored
        out.append(dataclasses.replace(mb, loss_mask=loss_mask))
        loss_tokens += int(loss_mask.sum())
        valid += int((mb.attention_mask.bool() & mine).sum())
    return out, torch.tensor([loss_tokens, valid], dtype=torch.float64, device=dims.device)


def forward_rows_cp(model, batch: RolloutBatch, *, replay: bool, pack: bool) -> "_step.RowForward":
    """:func:`workers.trainer.step.forward_rows` for a cp rank: the model on this rank's chunk,
    results in row layout with zeros at the other ranks' tokens/positions."""
    dims: ParallelDims = model.dims
    x = _step.forward_inputs(batch, replay=replay, pack=pack)
    b, width = x.ids.shape
    t = chunk_len(width, dims.cp)
    full = t * dims.cp
    positions = x.positions if x.positions is not None else torch.arange(width, device=x.ids.device).expand(b, width)
    attention = _pad(x.attention.bool(), full, False)
    cols = torch.arange(full, device=x.ids.device)
    need = _pad(x.need, full, False) & (cols // t == dims.cp_rank)
    shard = SeqShard(group=dims.get_group("cp"), size=dims.cp, rank=dims.cp_rank, valid=attention,
                     segment_ids=None if x.segments is None else _pad(x.segments, full, -1))
    ids = _pad(x.ids, full, 0)
    local = shard.local
    forced = None if x.forced is None else local(_pad(x.forced, full, 0))
    forced_mask = None if x.forced_mask is None else local(_pad(x.forced_mask, full, False))
    with _step.compute_context(model), _step.capture_routing(model) as routers:
        out = model(local(ids), position_ids=local(_pad(positions, full, 0)), attention_mask=local(attention),
                    forced_experts=forced, forced_mask=forced_mask, logits_mask=local(need), cp=shard)
    logp, entropy = _step.scatter_logprobs(model, out.logits, ids, need, batch.temperature)  # row layout
    prob_sums, counts = prob_stats([p for p, _ in routers], out.routed_experts, local(attention),
                                   model.config.num_experts)
    own = _place(_step.stack_own(routers, (b, t), ids.device), shard, full)
    routed = _place(out.routed_experts, shard, full)
    return _step.row_forward(x.packing, logp[:, :width], entropy[:, :width], own[:, :width], routed[:, :width],
                             prob_sums, counts)


def _pad(x: torch.Tensor, width: int, fill) -> torch.Tensor:
    """``x`` [B, T, ...] right-padded along time to ``width`` with ``fill``."""
    extra = width - x.shape[1]
    if extra == 0:
        return x
    return torch.cat([x, x.new_full((x.shape[0], extra, *x.shape[2:]), fill)], dim=1)


def _place(local: torch.Tensor, shard: SeqShard, width: int, fill: Optional[int] = 0) -> torch.Tensor:
    """A chunk's per-position values (no gradient) at their columns of a ``width``-wide zero tensor."""
    out = local.new_full((local.shape[0], width, *local.shape[2:]), fill)
    out[:, shard.rank * shard.local_len:(shard.rank + 1) * shard.local_len] = local
    return out
