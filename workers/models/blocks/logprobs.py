"""Log-probs and entropy of target tokens in sequence chunks: [N, V] logits never alive at once.

Why: at 131,072 positions and a 151k vocabulary the float32 logits alone are 80 GB, and the
log-softmax's backward keeps as much again. The trainer needs only log p(target) [N] (with grad)
and the entropy [N] (a metric). So the model's forward, when given a :class:`Scoring`, runs
``lm_head`` + the scorer ``chunk_tokens`` positions at a time, each chunk under non-reentrant
activation checkpointing: the forward keeps only the [N] results (and the hidden states it already
had), and the backward recomputes one chunk's logits at a time, so peak logit memory is
``chunk_tokens x V`` in both passes. Gradients are those of the unchunked computation (each
position's log-prob depends on its own hidden state only); tests/unit/models/test_chunked_logprobs.py
checks values and gradients against the full path, including the vocabulary-parallel scorer.

The scorer is the trainer plan's ``target_logprobs`` (workers/trainer/parallel/fsdp.py, or the TP plan's
vocab-parallel one in workers/trainer/parallel/tensor.py with its all-reduces): it runs inside
each chunk, so a vocabulary split over tensor-parallel ranks stays split, and the recompute
repeats its collectives in the same order on every rank.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

from workers.models.blocks.fused_logprobs import fused_target_logprobs
from workers.models.blocks.fused_loss_head import TokenLoss, fused_loss_logprobs

Scorer = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``(logits [n, V(local)], targets [n]) -> (log p [n] with grad, entropy [n] no grad)``."""


@dataclasses.dataclass
class Scoring:
    """What the forward scores instead of returning logits (``CausalLM.forward(score=...)``)."""

    targets: torch.Tensor
    """int64 [N]: the token each ``logits_mask`` position predicts, in the same row-major order."""
    scorer: Scorer
    chunk_tokens: int = 0
    """Positions per chunk (``trainer.logprob_chunk_tokens``); 0: one chunk (the [N, V] logits at once)."""
    fused_temperature: Optional[float] = None
    """Set (``trainer.logprob_head=fused``): score with the fused head at this temperature
    (workers/models/blocks/fused_logprobs.py) instead of ``scorer``, whenever the head's weight is a
    plain tensor (not a vocabulary-parallel DTensor shard: those keep ``scorer``)."""
    token_loss: Optional[TokenLoss] = None
    """Set with ``fused_temperature`` (``trainer.logprob_head=fused_loss``, a loss of per-token terms): the
    head takes the loss's gradient in its forward (workers/models/blocks/fused_loss_head.py) and the
    forward returns the loss (``head_loss``) with log-probs that carry no gradient. Where the fused
    head does not apply, ignored: the caller then gets ``head_loss`` None and log-probs with grad."""


def score_head(h: torch.Tensor, score: Scoring, head: Callable[[torch.Tensor], torch.Tensor],
               weight: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(log p [N], entropy [N], head_loss or None)``: :func:`chunked_logprobs`, or the loss-in-forward
    head when ``score.token_loss`` is set and the fused head applies."""
    if score.token_loss is not None and score.fused_temperature is not None and fusable(weight):
        loss, logp, entropy = fused_loss_logprobs(h, weight, score.targets, score.fused_temperature,
                                                  score.chunk_tokens, score.token_loss)
        return logp, entropy, loss
    logp, entropy = chunked_logprobs(h, score, head, weight)
    return logp, entropy, None


def chunked_logprobs(h: torch.Tensor, score: Scoring, head: Callable[[torch.Tensor], torch.Tensor],
                     weight: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p [N], entropy [N])`` of ``score.targets`` under ``head(h)`` for hidden states ``h`` [N, H]
    (``weight``: the head's [V, H] matrix, for the fused path)."""
    n, chunk = h.shape[0], score.chunk_tokens
    if score.fused_temperature is not None and fusable(weight):
        return fused_target_logprobs(h, weight, score.targets, score.fused_temperature, chunk)
    if chunk <= 0 or n <= chunk:
        return score.scorer(head(h), score.targets)
    recompute = torch.is_grad_enabled() and h.requires_grad
    logps, entropies = [], []
    for i in range(0, n, chunk):
        piece = (h[i:i + chunk], score.targets[i:i + chunk], head, score.scorer)
        logp, entropy = checkpoint(_score, *piece, use_reentrant=False) if recompute else _score(*piece)
        logps.append(logp)
        entropies.append(entropy)
    return torch.cat(logps), torch.cat(entropies)


def fusable(weight: Optional[torch.Tensor]) -> bool:
    """The fused head applies: a plain (not DTensor) [V, H] weight."""
    return isinstance(weight, torch.Tensor) and type(weight) in (torch.Tensor, torch.nn.Parameter) \
        and weight.dim() == 2


def _score(h: torch.Tensor, targets: torch.Tensor, head: Callable, scorer: Scorer):
    return scorer(head(h), targets)
