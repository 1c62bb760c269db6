"""What the multi-rank trainer-step parity tests share: one rank's step, and the comparison.

test_parity_parallel.py (every tp x ep x dp plan), test_parity_mesh.py (the mesh plan over
every family) and test_context_parallel.py (dp x cp) all run the same experiment: every rank
builds the seeded full model, shards it with the plan under test, runs the trainer's
``backward_step`` on its row shard and one AdamW step, and rank 0 saves the FULL HF gradients
and weights (:func:`step_and_save`); the test then holds them against a one-process float32
reference (:func:`assert_step_matches`). One copy of both means one set of tolerances.

Tolerances: loss and grad norm to rel 1e-5 (the layouts sum the same terms in other orders);
each gradient to 1e-6 + 1e-4 of its largest element; weights after AdamW to 1e-5 where the
gradient is well above AdamW's eps (:func:`weight_error`: below it, the first step's
lr * g / (|g| + eps) turns last-bit gradient differences into lr-sized weight differences).
"""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from workers.trainer.batch import RolloutBatch, shard_rows
from workers.trainer.step import backward_step

ADAM_EPS_SCALE = 1e-6
"""Gradient elements below this are within a few AdamW eps (1e-8): weights are compared only
where the gradient is well above eps (module docstring)."""


def step_and_save(model, dims, batch: RolloutBatch, cfg, out: str, **extra) -> dict:
    """This rank's trainer step on its row shard of ``batch``, then one AdamW step; rank 0 saves
    {stats, grads (full, clipped), weights (full), **extra} to ``out``. Returns the stats."""
    shard = shard_rows(batch, dims.batch_rank, dims.num_batch_shards)
    stats = backward_step(model, shard, cfg, dims)
    grads = model.full_grad_dict()  # after clipping: compared with the clipped reference
    torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas)).step()
    weights = model.full_state_dict()
    if dims.rank == 0:
        torch.save({"stats": stats, "grads": grads, "weights": weights, **extra}, out)
    return stats


def weight_error(got: torch.Tensor, want: torch.Tensor, grad: torch.Tensor) -> float:
    """Max |got - want| over the elements whose reference gradient is above :data:`ADAM_EPS_SCALE`."""
    keep = grad.abs() >= ADAM_EPS_SCALE
    return float((got - want).abs()[keep].max()) if bool(keep.any()) else 0.0


def assert_step_matches(got: dict, ref: dict, *, weights: Optional[str] = "eps", grad_names: bool = True) -> None:
    """``got`` (step_and_save's file) equals ``ref`` {loss, grad_norm, clipped, weights}.

    ``weights``: "eps" compares where the gradient is above AdamW's eps, "all" every element,
    None not at all (the caller has its own bound); ``grad_names``: the gradients carry the HF
    names in the model's order.
    """
    assert got["stats"]["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
    assert got["stats"]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    if grad_names:
        assert list(got["grads"]) == list(ref["clipped"]), "full_grad_dict: the HF names, in the model's order"
    for name, g in ref["clipped"].items():
        assert got["grads"][name].shape == g.shape, name
        err = float((got["grads"][name] - g).abs().max())
        assert err <= 1e-6 + 1e-4 * float(g.abs().max()), f"{name}: grad differs by {err:.3g}"
    if weights is None:
        return
    assert list(got["weights"]) == list(ref["weights"]), "full_state_dict keeps the HF names, in order"
    for name, w in ref["weights"].items():
        if weights == "eps":
            err = weight_error(got["weights"][name], w, ref["clipped"].get(name, torch.ones_like(w)))
        else:
            err = float((got["weights"][name] - w).abs().max())
        assert err < 1e-5, f"{name}: weights after AdamW differ by {err:.3g}"
