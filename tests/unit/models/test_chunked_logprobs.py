"""Chunked scoring (workers/models/blocks/logprobs.py) equals the full-logits path, values and gradients,
and never asks the head for more than ``chunk_tokens`` positions at once, in the forward or the backward."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import compose
from workers.common.registry import MODELS
from workers.models.blocks.logprobs import Scoring
from workers.trainer.loss import token_logprobs
from workers.trainer.step import place, predicted
from workers.trainer.parallel.tensor import vocab_parallel_target_logprobs

torch.set_num_threads(1)


def scorer(z, y):
    return vocab_parallel_target_logprobs(z, y, 0.7, vocab_start=0, group=None)


@pytest.mark.parametrize("preset", ["tiny_moe", "tiny_dense"])  # untied and tied lm_head
def test_chunked_equals_full_logits_and_bounds_the_head(preset):
    cfg = compose([f"model={preset}"]).model
    model = MODELS.get(cfg.family).init(cfg, torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (3, 10), generator=g)
    need = torch.ones_like(ids, dtype=torch.bool)
    need[:, -1] = False  # the last position predicts nothing
    need[1, :4] = False  # a prompt: not scored
    at = predicted(need)
    w = torch.randn(3, 10, generator=g)

    def run(chunk):
        model.zero_grad()
        rows = []
        head = type(model).head.__get__(model)
        model.head = lambda h: rows.append(h.shape[0]) or head(h)
        try:
            out = model(ids, logits_mask=need, score=Scoring(targets=ids[at], scorer=scorer, chunk_tokens=chunk))
            logp, ent = place(at, out.logp), place(at, out.entropy)
            assert out.logits is None and not out.entropy.requires_grad
            (logp * w).sum().backward()
        finally:
            del model.head
        return logp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}, rows

    full_logp, full_ent, full_grads, full_rows = run(0)
    logp, ent, grads, rows = run(4)
    assert full_rows == [int(need.sum())]  # one call, every scored position
    assert max(rows) <= 4 and sum(rows) == 2 * int(need.sum())  # forward + recompute, 4 at a time
    torch.testing.assert_close(logp, full_logp)
    torch.testing.assert_close(ent, full_ent)
    for name, grad in full_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=name)
    # and the full path itself is the plain log-softmax of every logit at temperature 0.7
    ref, ref_ent = token_logprobs(model(ids).logits.detach(), ids, 0.7)
    torch.testing.assert_close(full_logp[at], ref[at])
    torch.testing.assert_close(full_ent[at], ref_ent[at])


def test_no_grad_scoring_does_not_checkpoint():
    cfg = compose(["model=tiny_moe"]).model
    model = MODELS.get(cfg.family).init(cfg, torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    need = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        out = model(ids, logits_mask=need, score=Scoring(targets=ids.flatten(), scorer=scorer, chunk_tokens=5))
    assert out.logp.shape == (18,) and not out.logp.requires_grad
