"""Sibling fp8 projections that read the same input as ONE GEMM: q/k/v, and gate/up of a dense MLP.

Why: a decode step at 128 rows is a chain of small GEMMs; with fp8 each projection also quantizes its
input first. q, k and v (and gate and up) multiply the same normed hidden state, so quantizing it once
and multiplying by the three weights stacked along the output width is the same math (per-token and
1x128 activation scales do not depend on the weight; per-row and 128x128 weight scales stack with their
rows) in one quantize kernel and one GEMM instead of three of each.

How, without changing the model: the modules stay where they are, with their bf16 ``weight`` parameters
(what loaders, patches and digests see). Their fp8 buffers become row slices (views) of one stacked
buffer, so the in-place re-quantization after a weight update (fp8.py's ``requantize``) writes the
stacked buffer too. The first sibling called on a tensor computes every sibling's output; the others,
called on the SAME tensor object (attention.py, mlp.py, nemotron_h: ``q_proj(x)``, ``k_proj(x)``, ...),
take their column slice. A sibling called on another tensor, or twice, computes the stacked GEMM again,
so a model that calls them differently stays correct (only slower). Under CUDA graphs this bookkeeping
runs once, at capture.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from workers.inference.embedded.fp8_kernels import fp8_matmul

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Children of one parent module that read the same input in every builtin family."""


class SharedInput:
    """One stacked fp8 weight for sibling :class:`~workers.inference.embedded.fp8.Fp8Linear` modules."""

    def __init__(self, members: list[nn.Module]):
        self.members = members
        self.scheme = members[0].scheme
        self.qweight = torch.cat([m.qweight for m in members])  # [sum N, K]
        self.qscale = torch.cat([m.qscale for m in members])  # [sum N] rows, or [sum N / 128, K / 128] blocks
        self.columns: list[tuple[int, int]] = []
        w0 = s0 = 0
        for m in members:
            w1, s1 = w0 + m.qweight.shape[0], s0 + m.qscale.shape[0]
            m._buffers["qweight"], m._buffers["qscale"] = self.qweight[w0:w1], self.qscale[s0:s1]
            m.fused = self
            self.columns.append((w0, w1))
            w0, s0 = w1, s1
        self._input: Optional[torch.Tensor] = None
        self._pending: dict[int, torch.Tensor] = {}

    def output(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``mod``'s projection of ``x`` as ``[rows, out_features]`` (a column slice of the stacked GEMM)."""
        i = next(j for j, m in enumerate(self.members) if m is mod)
        if self._input is x and i in self._pending:
            y = self._pending.pop(i)
            if not self._pending:
                self._input = None  # every sibling served: hold no activations between steps
            return y
        y = fp8_matmul(x.reshape(-1, x.shape[-1]), self.qweight, self.qscale, self.scheme)
        outs = [y[:, a:b] for a, b in self.columns]
        self._pending = {j: o for j, o in enumerate(outs) if j != i}
        self._input = x
        return outs[i]


def _fusable(mods: list, Fp8Linear: type) -> bool:
    first = mods[0]
    return (len(mods) > 1 and all(type(m) is Fp8Linear and m.fused is None for m in mods)
            and all(m.scheme == first.scheme and m.in_features == first.in_features
                    and m.qweight.device == first.qweight.device for m in mods))


def fuse_siblings(model: nn.Module, Fp8Linear: type) -> int:
    """Stack every group of :data:`SIBLINGS` of ``model`` that are all ``Fp8Linear`` (fp8.py's class, passed
    in so this module does not import fp8.py, which imports it) with the same input width and scheme (run
    after the fp8 buffers exist); how many groups."""
    groups = 0
    for parent in model.modules():
        for names in SIBLINGS:
            mods = [getattr(parent, n, None) for n in names]
            if all(m is not None for m in mods) and _fusable(mods, Fp8Linear):
                SharedInput(mods)
                groups += 1
    return groups
