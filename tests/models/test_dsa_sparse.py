"""GLM-5's memory-linear DSA path (workers/models/blocks/dsa_sparse.py) against the dense reference path.

The model is built from transformers' own GlmMoeDsaConfig (tiny, float32, seeded) and its
checkpoint, with ``index_topk`` smaller than the sequences (the choice matters) and query chunks
smaller than the sequence: the chunked indexer + gathered sparse attention must give the dense
path's logits and gradients, on plain, left-padded and packed rows, and never build a [T, T]
tensor, forward or backward (the dense path does, which shows the probe can see one).
"""
from __future__ import annotations

import pytest
import torch

from tests.models.test_parity_deepseek_v3 import hf_model, ours_from
from tests.models.test_parity_glm_moe_dsa import GLM, VARIANTS
from tests.unit.models.test_packing_families import _Shapes
from workers.trainer.packing import plan_packing

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """Ours from transformers' config + weights, with a shared ("S") layer reusing the previous choice."""
    hf, d = hf_model({**GLM, **VARIANTS["shared_layer_yarn"]}, tmp_path_factory.mktemp("glm"), family="glm_moe_dsa")
    ours, cfg = ours_from(hf, d, family="glm_moe_dsa")
    assert cfg.index_topk == 4 and cfg.dsa_chunk_tokens > 0  # sparse by default
    return ours


def set_chunk(model, chunk: int) -> None:
    for layer in model.model.layers:
        layer.self_attn.dsa_chunk = chunk


def run(model, chunk: int, ids, **kw):
    """(logits, grads) of a scalar that reads every logit, with ``chunk`` (0: dense reference)."""
    set_chunk(model, chunk)
    model.zero_grad()
    logits = model(ids, **kw).logits
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(9))
    (logits.float().log_softmax(-1) * w).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(got, ref, valid=None):
    (logits, grads), (ref_logits, ref_grads) = got, ref
    sel = (lambda x: x[valid]) if valid is not None else (lambda x: x)
    torch.testing.assert_close(sel(logits), sel(ref_logits), rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys() and grads
    assert not any("indexer" in n for n in grads)  # the choice is not differentiable, in both paths
    for name, g in ref_grads.items():  # relative to the tensor's largest entry (float sums in another order)
        err = float((grads[name] - g).abs().max())
        assert err <= 1e-5 * float(g.abs().max()) + 1e-9, f"{name}: gradient differs by {err:.3g}"


@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_chunked_sparse_path_equals_the_dense_reference(glm, chunk):
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(1))
    assert_same(run(glm, chunk, ids), run(glm, 0, ids))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, :5] = 0  # left padding, as the engine's prefill
    valid = mask.bool()
    assert_same(run(glm, chunk, ids, attention_mask=mask), run(glm, 0, ids, attention_mask=mask), valid)


def test_packed_rows_choose_and_attend_per_document(glm):
    lengths = [9, 4, 6, 0]
    ids = torch.randint(1, 96, (4, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.arange(12)[None] < torch.tensor(lengths)[:, None]
    ids = ids * mask
    p = plan_packing(mask)
    packed = dict(position_ids=p.position_ids, attention_mask=p.attention_mask, segment_ids=p.segment_ids)
    logits, grads = run(glm, 2, p.pack(ids), **packed)
    ref_logits, ref_grads = run(glm, 0, p.pack(ids), **packed)
    assert_same((logits, grads), (ref_logits, ref_grads), p.attention_mask.bool())
    alone, _ = run(glm, 0, ids, attention_mask=mask)  # each sample in its own row: what packing must give
    torch.testing.assert_close(p.unpack(logits)[mask], alone[mask], rtol=1e-4, atol=1e-5)


def test_decode_with_the_cache_equals_the_dense_reference(glm):
    """The engine's path: left-padded prefill into a KV cache, then one token a step (keys from the cache)."""
    ids = torch.randint(1, 96, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    outs = {}
    for chunk in (0, 2):
        set_chunk(glm, chunk)
        cache = glm.new_cache()
        with torch.no_grad():
            steps = [glm(ids[:, :6], attention_mask=mask[:, :6], cache=cache).logits]
            for i in range(6, 9):
                steps.append(glm(ids[:, i:i + 1], attention_mask=mask[:, i:i + 1], cache=cache).logits)
        outs[chunk] = torch.cat(steps, dim=1)
    torch.testing.assert_close(outs[2][mask.bool()], outs[0][mask.bool()], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("packed", [False, True], ids=["row", "packed"])
def test_the_sparse_path_never_materialises_a_t_by_t_tensor(glm, packed, monkeypatch):
    """Forward + backward of one 97-token row with chunks of 8, as the trainer runs it (a packed row, or
    the GPU's mask-free causal path for a plain row): no op output has two dims of 97. The dense
    reference does build [T, T] tensors (the probe sees them)."""
    from workers.models.blocks import dsa_kernels, dsa_sparse, kernels

    t = 97
    # chunks are sized by memory budgets (dsa_kernels.py): shrunk so a 97-token row takes several chunks
    # of 8 queries, as a 131k-token one does at the real budgets
    monkeypatch.setattr(dsa_kernels, "SCORE_PAIRS", 8 * t)
    monkeypatch.setattr(dsa_sparse, "ATTENTION_BYTES", 1)
    ids = torch.randint(1, 96, (1, t), generator=torch.Generator().manual_seed(0))
    kw = dict(position_ids=torch.arange(t)[None])
    if packed:
        kw.update(attention_mask=torch.ones(1, t, dtype=torch.bool), segment_ids=torch.zeros(1, t, dtype=torch.long))
    else:
        monkeypatch.setattr(kernels, "FAST_PATH_ON_CPU", True)

    def squares(chunk: int) -> list:
        set_chunk(glm, chunk)
        shapes = _Shapes()
        with shapes.mode:
            glm(ids, **kw).logits.float().logsumexp(-1).sum().backward()
        assert any(t in s for _, s in shapes.seen)  # the probe saw the sequence
        return [(op, s) for op, s in shapes.seen if sum(d == t for d in s) >= 2]

    got = squares(8)
    assert not got, got[:3]
    assert squares(0), "the dense reference path should show [T, T] tensors"


def test_layer_checkpointing_around_the_chunk_checkpoints_keeps_the_gradients(glm):
    """The trainer wraps each layer in activation checkpointing (full) around the chunks' own
    checkpoints (nested, non-reentrant): same logits and gradients as the dense path without it."""
    import copy

    from workers.trainer.micro import apply_activation_checkpointing

    wrapped = copy.deepcopy(glm)
    apply_activation_checkpointing(wrapped.model.layers, "full")
    ids = torch.randint(1, 96, (2, 13), generator=torch.Generator().manual_seed(6))
    assert_same(run(wrapped, 4, ids), run(glm, 0, ids))
