"""Context parallelism in the trainer step (``trainer.parallel.cp``): one long sequence over cp ranks.

Layout (workers/trainer/parallel/dims.py): the cp ranks of a group hold the SAME rows (``batch_rank``
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
test_context_parallel.py). The same holds in the mesh plan with tp/ep > 1, where cp is a mesh
dimension (workers/trainer/parallel/mesh.py; tests/integration/test_context_parallel_mesh.py). A
row-level ratio (``ratio_level`` sequence / geometric) would need the whole row on one rank: the
plan refuses it with cp > 1 (launcher/resources.py), as it refuses a cp that does not divide the
Mamba-2 heads, and a sequence cp does not divide.

Collectives added per step (every rank of a cp group, in the same order, each bounded by the
process group's timeout like the step's other collectives): per attention layer four all-to-alls
forward (q, k, v to heads; the output back to tokens), per Mamba-2 layer five (x, B, C, dt; y
back), the same mirrored in the backward (and again in an activation-checkpointing recompute);
per DSA indexer layer two all-gathers (keys, chosen indices), no gradient.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from workers.models.blocks.ulysses import SeqShard
from workers.trainer.batch import RolloutBatch
from workers.trainer.parallel.dims import ParallelDims


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


@dataclasses.dataclass
class CpSplit:
    """One micro-batch's forward on a cp rank (workers/trainer/step.py ``forward_rows``)."""

    inputs: dict  # the model's keyword arguments: this rank's chunk, and ``cp`` (the SeqShard)
    ids: torch.Tensor  # [B, cp*t] the whole padded rows: the targets of the chunk's logits
    need: torch.Tensor  # [B, cp*t] logits to compute: this rank's positions only
    width: int  # the micro-batch's own width (before padding)

    def whole(self, logp: torch.Tensor, entropy: torch.Tensor, own: torch.Tensor,
              routed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Results back on the whole rows (log-probs are there already), trimmed to the micro-batch."""
        shard: SeqShard = self.inputs["cp"]
        own, routed = (_place(x, shard, self.ids.shape[1]) for x in (own, routed))
        return tuple(x[:, :self.width] for x in (logp, entropy, own, routed))


def split(model, inputs: dict) -> Optional[CpSplit]:
    """None unless the model's ``dims.cp`` > 1; else the rows padded to a multiple of cp and this
    rank's chunk of every per-position input (``position_ids`` the tokens' global, or packed, positions)."""
    dims: Optional[ParallelDims] = getattr(model, "dims", None)
    if dims is None or dims.cp == 1:
        return None
    ids, need, segments = inputs["input_ids"], inputs["logits_mask"], inputs["segment_ids"]
    b, width = ids.shape
    t = chunk_len(width, dims.cp)
    full = t * dims.cp
    if inputs["position_ids"] is None:  # each chunk needs its tokens' global positions
        inputs = {**inputs, "position_ids": torch.arange(width, device=ids.device).expand(b, width)}
    attention = _pad(inputs["attention_mask"].bool(), full, False)
    shard = SeqShard(group=dims.get_group("cp"), size=dims.cp, rank=dims.cp_rank, valid=attention,
                     segment_ids=None if segments is None else _pad(segments, full, -1))
    need = _pad(need, full, False) & (torch.arange(full, device=ids.device) // t == dims.cp_rank)
    fills = {"input_ids": 0, "position_ids": 0, "forced_experts": 0, "forced_mask": False}
    local = {k: None if inputs[k] is None else shard.local(_pad(inputs[k], full, fill)) for k, fill in fills.items()}
    local.update(attention_mask=shard.local(attention), logits_mask=shard.local(need), cp=shard)
    return CpSplit(inputs=local, ids=_pad(ids, full, 0), need=need, width=width)


def _pad(x: torch.Tensor, width: int, fill) -> torch.Tensor:
    """``x`` [B, T, ...] right-padded along time to ``width`` with ``fill``."""
    extra = width - x.shape[1]
    if extra == 0:
        return x
    return torch.cat([x, x.new_full((x.shape[0], extra, *x.shape[2:]), fill)], dim=1)


def _place(local: torch.Tensor, shard: SeqShard, width: int) -> torch.Tensor:
    """A chunk's per-position values (no gradient) at their columns of a ``width``-wide zero tensor."""
    out = local.new_zeros((local.shape[0], width, *local.shape[2:]))
    out[:, shard.rank * shard.local_len:(shard.rank + 1) * shard.local_len] = local
    return out
