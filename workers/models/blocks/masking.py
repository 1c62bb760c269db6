"""Sliding-window bands and attention sinks: the two attention variants every softmax path shares.

Sliding window (Mistral, Qwen2/3 with ``use_sliding_window``, Gemma 3's local layers, GPT-OSS's
alternating layers): a query at index ``p`` sees the keys at indices in ``(p - window, p]``, i.e.
``window`` keys including itself. That is transformers' rule (masking_utils ``sliding_window_overlay``:
``kv_idx > q_idx - sliding_window`` on top of the causal mask), over cache indices; in every path
we run, a row's valid tokens are contiguous (left pads, packed documents, static slots holding
position p at index p), so index distance is position distance and the band is the same thing.

Attention sinks (GPT-OSS's ``self_attn.sinks``, one learned logit per query head): each row's
softmax gets one more logit whose probability is dropped, so the weights of the real keys sum to
less than 1 (``p_j = exp(s_j) / (sum_k exp(s_k) + exp(sink))``). :func:`with_sinks` makes that an
ordinary attention over one more key, so every SDPA kernel, mask and path computes it with the
softmax's own max-subtraction (numerically stable, no log-sum-exp of our own): the queries get
one more channel holding ``sink / scale``, real keys a zero there, and the extra key is the unit
vector of that channel with a zero value. Its score is ``scale * (sink / scale) * 1 = sink`` for
every query of that head; real scores are unchanged; the extra key is shared by all heads (a GQA
kv head needs no copy) and visible to every query. Gradients reach ``sinks`` through the channel.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def window_band(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """bool ``[..., Tq, Tk]``: key index > query index - window (the lower edge; causality is separate)."""
    return k_pos[..., None, :] > q_pos[..., :, None] - window


def causal_mask(t: int, device, window: Optional[int] = None) -> torch.Tensor:
    """bool ``[t, t]``: causal, and within ``window`` keys when given."""
    pos = torch.arange(t, device=device)
    keep = pos[None, :] <= pos[:, None]
    return keep if window is None else keep & window_band(pos, pos, window)


def narrows(window: Optional[int], keys: int) -> bool:
    """Does a window of ``window`` keys change attention over ``keys`` keys? (None: no window)"""
    return window is not None and window < keys


def with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor,
               scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v, mask)`` with the sink key appended (module docstring). ``q [B, H, Tq, D]``,
    ``k``/``v [B, Hk, Tk, D|Dv]`` (Hk divides H, the grouped layout), ``mask`` bool broadcastable to
    ``[B, 1|H, Tq, Tk]``, ``sinks [H]``; ``scale`` is the softmax scale of the ORIGINAL head width.
    On CUDA the q/k channels are zero-padded to a multiple of 8 (the fused kernels' alignment)."""
    b, h, tq, d = q.shape
    extra = 1 + ((-(d + 1)) % 8 if q.is_cuda else 0)
    col = (sinks.to(q.dtype) / scale).view(1, h, 1, 1).expand(b, h, tq, 1)
    q = torch.cat([q, F.pad(col, (0, extra - 1))], dim=-1)
    # e_0 built on the device (``unit[0] = 1`` copies a host scalar: CUDA-graph capture refuses it)
    unit = (torch.arange(extra, device=k.device) == 0).to(k.dtype)
    sink_key = torch.cat([torch.zeros(d, dtype=k.dtype, device=k.device), unit]).expand(b, k.shape[1], 1, d + extra)
    k = torch.cat([F.pad(k, (0, extra)), sink_key], dim=-2)
    v = torch.cat([v, v.new_zeros(b, v.shape[1], 1, v.shape[-1])], dim=-2)
    return q, k, v, F.pad(mask, (0, 1), value=True)
