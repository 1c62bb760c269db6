"""DSA's causal top-k choice (workers/models/blocks/dsa_kernels.py): the large-chunk path equals the
old 256-query path with every key scored, and the Triton index-score kernel, run by Triton's CPU
interpreter (``TRITON_INTERPRET=1``, in a subprocess: the flag is read when the kernel is
defined), equals the torch reference scores and picks the same keys, in float32 and with bf16
queries and keys (tensor-core dots, float32 accumulation: the same numbers up to the sums' order)."""
from __future__ import annotations

import textwrap

import pytest
import torch

from tests.helpers.triton_interpreter import assert_ok_under_interpreter
from workers.models.blocks import dsa_kernels
from workers.models.blocks.dsa_kernels import causal_topk, reference_scores
from workers.models.blocks.dsa_sparse import attention_chunk, topk_rows, visible_rows

torch.set_num_threads(1)


def inputs(b=2, t=37, s=None, h=3, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = s or t
    return (torch.randn(b, t, h, d, generator=g), torch.randn(b, s, d, generator=g), torch.rand(b, t, h, generator=g))


@pytest.mark.parametrize("first", [0, 5])
def test_large_chunks_with_causal_key_cut_equal_every_key_scored(first, monkeypatch):
    q, k, w = inputs(s=37 + first)
    scale, topk = 0.25, 8
    old = topk_rows(lambda a, b: reference_scores(q[:, a:b], k, w[:, a:b], scale),
                    visible_rows(None, None, 2, k.shape[1], first, 0, "cpu"), 37, k.shape[1], topk, 4)
    monkeypatch.setattr(dsa_kernels, "SCORE_PAIRS", 10 * k.shape[1])  # 10 queries a chunk: several chunks
    new = causal_topk(lambda a, b, c: reference_scores(a, b, c, scale), q, k, w, scale=scale, topk=topk,
                      first=first, min_chunk=1, kernel=False)
    # the same keys up to ties: relu makes exact-zero scores, and topk breaks ties in no fixed order
    scores = reference_scores(q, k, w, scale)
    picked = [scores.gather(-1, p.clamp(min=0).long()).masked_fill(p < 0, -1.0).sort(-1).values for p in (new, old)]
    assert torch.equal(picked[0], picked[1])
    assert torch.equal((new >= 0).sum(-1), (old >= 0).sum(-1))
    assert (new[:, 0] >= 0).sum(-1).tolist() == [min(topk, first + 1)] * 2  # -1 where fewer keys are visible


def test_chunk_sizes_are_bounded_budgets():
    assert dsa_kernels.chunk_queries(131072, 256) == 2048 and dsa_kernels.chunk_queries(8192, 256) == 32768
    assert attention_chunk(256, 256, 24, 4, 2) > 16384  # the tiny GLM-5 at 131k: a handful of chunks
    assert 256 <= attention_chunk(256, 2048, 576, 64, 2) < 512  # GLM-5's real widths: about the configured 256


SCRIPT = textwrap.dedent("""
    import torch
    from workers.models.blocks import dsa_kernels
    from workers.models.blocks.dsa_kernels import causal_topk, index_scores, reference_scores
    assert dsa_kernels.use_kernel(torch.zeros(1))
    g = torch.Generator().manual_seed(3)
    for b, t, s, h, d, first in ((1, 70, 70, 2, 16, 0), (2, 33, 90, 3, 24, 57)):
        q, k = torch.randn(b, t, h, d, generator=g), torch.randn(b, s, d, generator=g)
        w = torch.rand(b, t, h, generator=g)
        got = index_scores(q, k, w, 0.3, first)
        want = reference_scores(q, k, w, 0.3)
        future = torch.arange(s)[None, :] > (first + torch.arange(t))[:, None]
        want = want.masked_fill(future[None], float("-inf"))
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        torch.testing.assert_close(got[~torch.isinf(got)], want[~torch.isinf(want)], rtol=1e-5, atol=1e-5)
        picks = [causal_topk(lambda a, bb, c: reference_scores(a, bb, c, 0.3), q, k, w, scale=0.3, topk=6,
                             first=first, min_chunk=1, kernel=kern) for kern in (True, False)]
        chosen_scores = [want.gather(-1, p.clamp(min=0).long()).masked_fill(p < 0, -1.0).sort(-1).values
                         for p in picks]
        torch.testing.assert_close(chosen_scores[0], chosen_scores[1], rtol=1e-5, atol=1e-5)
    # bf16 index queries and keys (the bf16 model): bf16 dots, float32 sums; the reference upcasts first.
    # Products of bf16 values are exact in float32: only the order of the sums differs. (The interpreter's
    # bf16 tl.dot is broken, so on CPU the kernel upcasts; tests/gpu/test_dsa_fused_gpu.py runs bf16 dots.)
    q, k = torch.randn(1, 40, 4, 32, generator=g).bfloat16(), torch.randn(1, 64, 32, generator=g).bfloat16()
    w = torch.rand(1, 40, 4, generator=g)
    got = index_scores(q, k, w, 0.2, 24)
    want = reference_scores(q, k, w, 0.2).masked_fill(torch.isinf(got), float("-inf"))
    assert got.dtype == torch.float32 and torch.isinf(got).any() and not torch.isinf(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    print("ok")
""")


def test_triton_index_kernel_under_the_interpreter_equals_the_reference():
    assert_ok_under_interpreter(SCRIPT)
