"""The policy loss as per-token terms for the loss-in-forward head (``trainer.logprob_head=fused_loss``).

Why: the fused head computes each chunk's logits twice (forward, then again in the backward) because
it keeps no ``[N, V]`` block. When every term of the loss depends on one position's log-prob only,
the head can take the loss's gradient in its forward instead (workers/models/blocks/fused_loss_head.py)
and skip the second pass: three vocabulary GEMMs instead of four. That holds for the policy loss of
workers/trainer/loss.py with ``ratio_level=token`` (each token's own importance ratio, cap, mask and
clip), any ``loss_agg`` (the per-token weights and the global normaliser are known before the
forward), the KL to a reference (per token), and no entropy bonus (its gradient runs through the
entropy, which this head does not differentiate). Where it does not hold (``ratio_level`` sequence or
geometric: a row's ratio needs the whole row; ``entropy_coef`` > 0; context parallelism, whose
scored positions are another rank's layout) the trainer keeps the two-pass fused head.

:func:`token_loss` hands the head a closure over the micro-batch's per-token inputs, gathered into
the order of the scored positions once; it calls :func:`policy_loss_terms` itself on each chunk, so
the gradient is the loss code's own, not a second copy of its derivative.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from workers.common.config import TrainerConfig
from workers.models.blocks.fused_loss_head import TokenLoss
from workers.trainer.batch import RolloutBatch
from workers.trainer.loss import policy_loss_terms

Flatten = Callable[[torch.Tensor], torch.Tensor]
"""``[B, T]`` per-token values -> ``[N]`` in the order of the forward's scored positions."""


def applies(tcfg: TrainerConfig, cp: int) -> bool:
    """The loss is a sum of per-token terms the head can differentiate (module docstring)."""
    return (tcfg.logprob_head == "fused_loss" and tcfg.ratio_level == "token" and tcfg.entropy_coef == 0
            and cp == 1)


def loss_kwargs(tcfg: TrainerConfig) -> dict:
    """The :func:`policy_loss_terms` settings of ``tcfg`` (the trainer's loss and this module's chunks)."""
    return dict(ratio_cap=tcfg.ratio_cap, ratio_mask_low=tcfg.ratio_mask_low, ratio_mask_high=tcfg.ratio_mask_high,
                ratio_level=tcfg.ratio_level, clip_low=tcfg.clip_low, clip_high=tcfg.clip_high,
                kl_coef=tcfg.kl_coef, kl_estimator=tcfg.kl_estimator)


def token_loss(mb: RolloutBatch, loss_mask: torch.Tensor, tcfg: TrainerConfig, num_loss_tokens: float
               ) -> Callable[[Flatten], TokenLoss]:
    """A factory the forward calls with its :data:`Flatten`: the chunked policy loss of ``mb``."""
    adv = mb.advantages[:, None].expand(loss_mask.shape) if mb.advantages.dim() == 1 else mb.advantages

    def bind(flat: Flatten) -> TokenLoss:
        cols = {"inference": flat(mb.inference_logprobs), "adv": flat(adv), "mask": flat(loss_mask),
                "weight": None if mb.token_weight is None else flat(mb.token_weight),
                "ref": None if mb.ref_logprobs is None else flat(mb.ref_logprobs)}

        def chunk_loss(lp: torch.Tensor, a: int, b: int) -> torch.Tensor:
            def cut(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
                return None if x is None else x[a:b][None]  # [1, c]: one "row" of per-token values
            loss, _ = policy_loss_terms(lp[None], cut(cols["inference"]), cut(cols["adv"]), cut(cols["mask"]),
                                        num_loss_tokens=num_loss_tokens, token_weight=cut(cols["weight"]),
                                        ref_logprobs=cut(cols["ref"]), entropy=None, entropy_coef=0.0,
                                        **loss_kwargs(tcfg))
            return loss
        return chunk_loss
    return bind
