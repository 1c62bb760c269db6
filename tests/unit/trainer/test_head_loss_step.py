"""``trainer.logprob_head=fused_loss`` (the loss's gradient taken in the head's forward,
workers/trainer/head_loss.py) gives the trainer step the gradients and statistics of the two-pass
``fused`` head: one micro-batch and several, packed rows, the KL to a reference, Router Replay; and
where the loss is not a sum of per-token terms (``ratio_level=geometric``, an entropy bonus) the
step keeps the two-pass head."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from tests.integration import test_parity_parallel as moe
from workers.models.blocks import fused_loss_head
from workers.trainer.parallel.fsdp import parallelize
from workers.trainer.step import backward_step


def step_grads(dims, base, batch, cfg, monkeypatch) -> tuple[dict, dict, int]:
    """(gradients, statistics, how many times the loss-in-forward head ran) of one backward_step."""
    runs = []
    real = fused_loss_head.fused_loss_logprobs
    monkeypatch.setattr("workers.models.blocks.logprobs.fused_loss_logprobs",
                        lambda *a, **k: runs.append(1) or real(*a, **k))
    model = parallelize(copy.deepcopy(base), dims)
    stats = backward_step(model, batch, cfg, dims)
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
             for n, p in model.named_parameters() if p.grad is not None}
    return grads, stats, len(runs)


CASES = {
    "one_micro_batch": dict(),
    "micro_batches": dict(micro_batch_tokens=30),
    "packed": dict(pack_sequences=True),
    "kl_reference": dict(kl_coef=0.1, kl_estimator="k3", clip_low=0.2, clip_high=0.28),
    "geometric": dict(ratio_level="geometric"),
    "entropy_bonus": dict(entropy_coef=0.01),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_loss_step_equals_fused_step(dims, case, monkeypatch):
    base = moe.build_model(moe.CFG, moe.SEED)
    batch = moe.make_batch()
    if case == "kl_reference":
        g = torch.Generator().manual_seed(3)
        batch = dataclasses.replace(batch, ref_logprobs=batch.inference_logprobs + 0.1 * torch.randn(
            batch.inference_logprobs.shape, generator=g) * batch.loss_mask)
    extra = CASES[case]
    got, got_stats, runs = step_grads(dims, base, batch, moe.tcfg(logprob_head="fused_loss", **extra), monkeypatch)
    want, want_stats, none = step_grads(dims, base, batch, moe.tcfg(logprob_head="fused", **extra), monkeypatch)
    took = case not in ("geometric", "entropy_bonus")
    assert none == 0 and (runs > 0) == took, (case, runs)
    assert set(got) == set(want)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=name)
    for key in ("pg_loss", "grad_norm", "mismatch", "ratio_mean", "entropy"):
        if key in want_stats:
            assert got_stats[key] == pytest.approx(want_stats[key], rel=1e-4, abs=1e-7), key
    assert any(float(g.abs().sum()) > 0 for g in want.values())


def test_the_compared_statistics_exist(dims, monkeypatch):
    _, stats, _ = step_grads(dims, moe.build_model(moe.CFG, moe.SEED), moe.make_batch(), moe.tcfg(), monkeypatch)
    assert {"pg_loss", "grad_norm", "entropy"} <= set(stats), sorted(stats)
