"""Mixed precision of the trainer: master weights and AdamW state in ``trainer.master_dtype``
(float32 unless asked otherwise), compute in ``trainer.dtype``, gradients reduced in float32.

Why: AdamW's update at the presets' learning rate (1e-6) is far below bfloat16's resolution
(8 mantissa bits: a relative step under ~2^-9 rounds back to the same weight), so a model whose
parameters ARE bfloat16 barely learns (benchmarks/results/trainer_memory.json: 1.9% of a matrix's
weights change at lr 1e-6, 99.98% with float32 master weights). The master copy is what the
optimizer steps; the forward sees it cast to the compute dtype:

- both plans (workers/trainer/parallel/fsdp.py, and workers/trainer/parallel/mesh.py with tp/ep): FSDP2's
  ``MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=float32)`` casts each layer's (and each
  MoE block's experts') gathered parameters once per forward and reduces the gradients in float32
  into float32 sharded gradients.

float32 compute over float32 master weights is exactly the old float32 trainer (no cast, no
autocast). ``master_dtype=bfloat16`` (only with ``dtype=bfloat16``) is the old pure-bf16
trainer; the plan warns about it (workers.common.config.trainer.check_precision).
"""
from __future__ import annotations

import dataclasses

import torch

from workers.common.config.trainer import check_precision
from workers.common.dtypes import torch_dtype


@dataclasses.dataclass(frozen=True)
class Precision:
    master: torch.dtype
    """Parameters as the optimizer sees and steps them (and the AdamW moments)."""
    compute: torch.dtype
    """Forward / backward matmuls."""

    @classmethod
    def of(cls, tcfg) -> "Precision":
        check_precision(tcfg.dtype, tcfg.master_dtype)
        return cls(master=torch_dtype(tcfg.master_dtype, "trainer.master_dtype"),
                   compute=torch_dtype(tcfg.dtype, "trainer.dtype"))

    @property
    def mixed(self) -> bool:
        return self.master != self.compute


def update_fraction(master: torch.dtype, *, size: int = 1024, steps: int = 3, lr: float = 1e-6,
                    seed: int = 0) -> float:
    """Fraction of a ``size x size`` matrix's weights that ``steps`` AdamW steps at ``lr`` change
    when the parameter (and so AdamW's state) is held in ``master``.

    Weights ~ N(0, 0.02) like an initialised projection, gradients ~ N(0, 1e-3) computed in
    bfloat16 (as a bf16 forward would produce them); compared in the master dtype itself: the
    weights the next forward would read.
    """
    g = torch.Generator().manual_seed(seed)
    w0 = (torch.randn(size, size, generator=g) * 0.02).to(master)
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.AdamW([p], lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    for _ in range(steps):
        p.grad = (torch.randn(size, size, generator=g) * 1e-3).to(torch.bfloat16).to(master)
        opt.step()
    return float((p.detach() != w0).float().mean())
