"""Packed rows through every family equal the unpacked rows: forward, backward and Router Replay.

The packed forward never builds a [T, T] mask (workers/models/blocks/varlen.py): attention runs per
document, the DSA indexer picks its top-k inside a document (in query chunks), Mamba-2 restarts its state at each
document. The reference is today's masked path on the UNPACKED right-padded rows (each sample
alone in its row), which is what a packed sample must reproduce exactly.
"""
from __future__ import annotations

import pytest
import torch

from tests.conftest import compose
from workers.common.registry import MODELS
from workers.models.blocks import dsa_kernels, dsa_sparse, varlen
from workers.models.blocks.varlen import Documents
from workers.trainer.packing import plan_packing

torch.set_num_threads(1)

PRESETS = ["tiny_moe", "tiny_dense", "qwen3_moe_tiny", "deepseek_v3_tiny", "glm_moe_dsa_tiny", "nemotron_h_tiny",
           "mistral_tiny"]  # mistral_tiny: a sliding window (8) shorter than the 11-token document
LENGTHS = [5, 11, 3, 7, 0]  # FFD packs these into rows of 12: [11], [7, 5], [3]


def build(preset: str):
    cfg = compose([f"model={preset}"]).model
    return MODELS.get(cfg.family).init(cfg, torch.float32), cfg


def batch(cfg, seed=0, t=12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, cfg.vocab_size, (len(LENGTHS), t), generator=g)
    mask = torch.arange(t)[None] < torch.tensor(LENGTHS)[:, None]
    return ids * mask, mask


def score(logits, weights):
    """A scalar that depends on every valid logit (so the gradient reaches every weight)."""
    return (logits.float().log_softmax(-1) * weights).sum()


@pytest.mark.parametrize("preset", PRESETS)
def test_packed_forward_backward_and_replay_equal_unpacked_rows(preset):
    model, cfg = build(preset)
    ids, mask = batch(cfg)
    p = plan_packing(mask)
    assert p.pack(ids).shape[0] == 3
    g = torch.Generator().manual_seed(7)
    w = torch.randn(*ids.shape, cfg.vocab_size, generator=g) * mask[..., None]

    def run(packed: bool, forced=None):
        model.zero_grad()
        if packed:
            out = model(p.pack(ids), position_ids=p.position_ids, attention_mask=p.attention_mask,
                        segment_ids=p.segment_ids, forced_experts=None if forced is None else p.pack(forced),
                        forced_mask=None if forced is None else p.attention_mask)
            logits, routed = p.unpack(out.logits), p.unpack(out.routed_experts)
        else:
            out = model(ids, attention_mask=mask, forced_experts=forced, forced_mask=None if forced is None else mask)
            logits, routed = out.logits, out.routed_experts
        score(logits, w).backward()
        return logits.detach(), routed, {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}

    ref_logits, ref_routed, ref_grads = run(False)
    logits, routed, grads = run(True)
    torch.testing.assert_close(logits[mask], ref_logits[mask], rtol=1e-4, atol=1e-5)
    assert torch.equal(routed[mask], ref_routed[mask])
    assert grads.keys() == ref_grads.keys() and grads
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-3, atol=1e-5, msg=name)
    if routed.shape[2]:  # Router Replay: force experts the router would not choose, per position
        forced = torch.randint(0, cfg.num_experts, ref_routed.shape, generator=g)
        forced = torch.sort(forced, dim=-1).values
        forced[..., 1:] = torch.where(forced[..., 1:] == forced[..., :-1], (forced[..., :-1] + 1) % cfg.num_experts,
                                      forced[..., 1:])
        ref_logits, ref_routed, ref_grads = run(False, forced)
        logits, routed, grads = run(True, forced)
        assert torch.equal(routed[mask], forced[mask]) and torch.equal(ref_routed[mask], forced[mask])
        torch.testing.assert_close(logits[mask], ref_logits[mask], rtol=1e-4, atol=1e-5)
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-3, atol=1e-5, msg=name)


def test_documents_runs_and_cu_seqlens():
    seg = torch.tensor([[0, 0, 1, 1, 1, -1], [0, 0, 0, 0, 0, 0]])
    d = Documents.from_segments(seg)
    assert d.runs == [[(0, 2, True), (2, 5, True), (5, 6, False)], [(0, 6, True)]]
    assert d.cu_seqlens("cpu").tolist() == [0, 2, 5, 6, 12] and d.max_len == 6
    with pytest.raises(ValueError, match="contiguous"):
        Documents.from_segments(torch.tensor([[0, 1, 0]]))


def test_attend_docs_is_per_document_causal_and_pads_attend_to_themselves():
    seg = torch.tensor([[0, 0, 0, 1, 1, -1, -1]])
    docs = Documents.from_segments(seg)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 7, 6, generator=g) for _ in range(2))
    v = torch.randn(1, 2, 7, 4, generator=g, requires_grad=True)  # MLA-like: value dim != key dim
    out = varlen.attend_docs(q, k, v, docs, scale=0.3)
    same = (seg[0, :, None] == seg[0, None, :]) & (seg[0, :, None] >= 0) & torch.ones(7, 7, dtype=torch.bool).tril()
    same |= torch.eye(7, dtype=torch.bool)
    ref = torch.softmax((q @ k.transpose(-1, -2) * 0.3).masked_fill(~same, float("-inf")), -1) @ v
    torch.testing.assert_close(out, ref)
    out[:, :, 3:5].sum().backward()  # document 1 reads only its own values
    assert v.grad[:, :, :3].abs().max() == 0 and v.grad[:, :, 5:].abs().max() == 0


def test_the_varlen_branch_flattens_runs_into_cu_seqlens(monkeypatch):
    """The CUDA branch (one varlen launch over [B*T, H, D]) checked on CPU against the per-document
    loop, with a stand-in kernel that takes the same arguments as torch's ``varlen_attn``."""
    calls = []

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size):
        assert torch.equal(cu_q, cu_k) and window_size == (-1, 0)
        calls.append((cu_q.tolist(), max_q))
        pieces = [varlen.causal_sdpa(*(x[a:b].transpose(0, 1)[None] for x in (q, k, v)), scale)[0].transpose(0, 1)
                  for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist())]
        return torch.cat(pieces)

    seg = torch.tensor([[0, 0, 0, 1, 1, -1], [0, 0, 0, 0, 1, 1]])
    docs = Documents.from_segments(seg)
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(2, 3, 6, 8, generator=g) for _ in range(2))
    v = torch.randn(2, 3, 6, 5, generator=g)
    want = varlen.attend_docs(q, k, v, docs, scale=0.25)
    monkeypatch.setattr(varlen, "_VARLEN", fake_varlen)
    monkeypatch.setitem(varlen._VARLEN_CAUSAL, "window_size", (-1, 0))
    monkeypatch.setattr(varlen, "varlen_ok", lambda q, v, window=None: True)
    got = varlen.attend_docs(q, k, v, docs, scale=0.25)
    assert calls == [([0, 3, 5, 6, 10, 12], 4)]
    torch.testing.assert_close(got[0, :, :5], want[0, :, :5])  # the padding run differs: nobody reads it
    torch.testing.assert_close(got[1], want[1])


class _Shapes:
    """Every tensor shape any op produces (forward and backward), through a dispatch mode."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        seen = self.seen = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else [out]:
                    if isinstance(t, torch.Tensor):
                        seen.append((str(func), tuple(t.shape)))
                return out

        self.mode = Mode()


@pytest.mark.parametrize("preset", PRESETS)
def test_a_packed_row_never_materialises_a_t_by_t_tensor(preset, monkeypatch):
    """One 257-token document in a packed row, forward + backward: no op output has two dims of 257
    (the old block mask was [B, 1, T, T] and SDPA's masked path an [B, H, T, T] score matrix; DSA
    chooses and attends in query chunks, workers/models/blocks/dsa_sparse.py). DSA's chunks are
    sized by constant budgets (workers/models/blocks/dsa_kernels.py): shrunk here so that one
    257-token document needs several, as a 131k-token one does at the real budgets."""
    monkeypatch.setattr(dsa_kernels, "SCORE_PAIRS", 64 * 257)
    monkeypatch.setattr(dsa_sparse, "ATTENTION_BYTES", 1)
    model, cfg = build(preset)
    if cfg.family == "glm_moe_dsa":
        assert 0 < cfg.dsa_chunk_tokens < 257 and cfg.index_topk < 257  # chunks smaller than the document
    t = 257
    ids = torch.randint(1, cfg.vocab_size, (1, t), generator=torch.Generator().manual_seed(0))
    shapes = _Shapes()
    with shapes.mode:
        out = model(ids, position_ids=torch.arange(t)[None], attention_mask=torch.ones(1, t, dtype=torch.bool),
                    segment_ids=torch.zeros(1, t, dtype=torch.long))
        out.logits.float().logsumexp(-1).sum().backward()
    square = [(op, s) for op, s in shapes.seen if sum(d == t for d in s) >= 2]
    assert not square, square[:3]
    assert any(t in s for _, s in shapes.seen)  # the probe saw the sequence
