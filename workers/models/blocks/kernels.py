"""Kernel choices shared by every family: the GPU fast-path switch and attention through SDPA.

GPU fast paths (grouped-GEMM experts, causal flash attention) run on CUDA tensors only, so CPU
numerics stay exactly the reference path's. Tests set ``FAST_PATH_ON_CPU = True`` to exercise the
fast path on CPU against the reference; benchmarks pick SDPA backends here.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from workers.models.blocks.masking import causal_mask, narrows, with_sinks
from workers.models.blocks.varlen import Documents, attend_docs, attend_rows, varlen_ok, windowed_sdpa

FAST_PATH_ON_CPU = False

#: SDPA backends for masked attention on CUDA (decode with a KV cache, left padding). Not
#: cuDNN: it builds a graph per key length, i.e. on every decode step (~100 ms/step seen on H200).
MASKED_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
#: SDPA backends for the causal fast path (training, scoring); None leaves torch's choice (cuDNN on H100/H200).
CAUSAL_SDPA_BACKENDS: Optional[list] = None


def fast(x: torch.Tensor) -> bool:
    return x.is_cuda or FAST_PATH_ON_CPU


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
           scale: Optional[float] = None, docs: Optional[Documents] = None, *, window: Optional[int] = None,
           sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v over ``[B, H, T, D]`` (k and v already have q's heads).

    ``attn_mask`` None: plain causal (no pads before any valid key, no cache). ``docs`` (packed
    rows, ``ForwardContext.docs``): causal inside each document, linear in memory
    (workers/models/blocks/varlen.py); the mask is then unused. ``scale`` None: 1/sqrt(D).
    ``window`` (sliding-window attention, workers/models/blocks/masking.py) applies where this
    function builds the mask itself (``attn_mask`` None, ``docs``); a given ``attn_mask`` must
    already be banded (``ForwardContext.window_mask``). ``sinks`` ``[H]``: one sink logit per head
    (masking.with_sinks), exact in every path.
    """
    if docs is not None:
        return attend_docs(q, k, v, docs, scale, window=window, sinks=sinks)
    scale = q.shape[-1] ** -0.5 if scale is None else scale  # of the real head width (sinks add a channel)
    if attn_mask is None:
        t = q.shape[-2]
        if narrows(window, t) and sinks is None and varlen_ok(q, v, window):  # one banded flash launch, O(T) memory
            return attend_rows(q, k, v, scale, window)
        if narrows(window, t):  # no [T, T] mask: blocks of queries under their band
            return windowed_sdpa(q, k, v, scale, window, sinks)
        if sinks is not None:
            attn_mask = causal_mask(t, q.device)[None, None]
        elif CAUSAL_SDPA_BACKENDS is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            with sdpa_kernel(CAUSAL_SDPA_BACKENDS):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if sinks is not None:
        q, k, v, attn_mask = with_sinks(q, k, v, attn_mask, sinks, scale)
    if q.is_cuda:
        with sdpa_kernel(MASKED_SDPA_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
