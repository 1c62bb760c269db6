"""Sequence packing: bins within budget, exact per-sample math, nothing crosses a sample boundary."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.models.tiny_moe.model import TinyMoeConfig, build_model
from workers.trainer.packing import PackingError, pack_batch, pack_rows, plan_micro_batches, plan_packing

torch.set_num_threads(1)


def right_padded(lengths, t, vocab=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(lengths), t), generator=g)
    mask = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    return ids * mask, mask


def test_bins_respect_the_budget_and_cover_every_row_once():
    lengths = [7, 3, 9, 1, 4, 4, 10, 0, 2]
    bins = plan_micro_batches(lengths, token_budget=10)
    flat = sorted(r for b in bins for r in b)
    assert flat == [i for i, n in enumerate(lengths) if n > 0]
    assert all(sum(lengths[r] for r in b) <= 10 for b in bins)
    assert len(bins) == 4  # 40 tokens in bins of 10: first-fit-decreasing finds the optimum here
    assert bins == plan_micro_batches(lengths, token_budget=10)  # deterministic
    assert all(len(b) <= 2 for b in plan_micro_batches(lengths, token_budget=10, max_rows=2))
    with pytest.raises(PackingError, match="row 6 has 10 tokens > token_budget"):
        plan_micro_batches(lengths, token_budget=9)


def test_pack_rows_layout_and_round_trip():
    ids, mask = right_padded([3, 5, 2], 6)
    adv = torch.tensor([0.5, -1.0, 2.0])
    loss_mask = mask.clone()
    loss_mask[:, 0] = False
    mb = pack_rows({"input_ids": ids, "advantages": adv, "rewards": adv, "loss_mask": loss_mask},
                   [3, 5, 2], [2, 0], pad_to=8, expand_rows=("advantages",))
    assert mb.cu_seqlens.tolist() == [0, 2, 5] and mb.max_seqlen == 3 and mb.num_tokens == 8
    assert mb.position_ids.tolist() == [[0, 1, 0, 1, 2, 0, 0, 0]]
    assert mb.seq_ids.tolist() == [[0, 0, 1, 1, 1, -1, -1, -1]]
    assert mb.tensors["input_ids"][0, :5].tolist() == ids[2, :2].tolist() + ids[0, :3].tolist()
    assert mb.tensors["advantages"][0].tolist() == [2.0, 2.0, 0.5, 0.5, 0.5, 0, 0, 0]
    assert mb.tensors["rewards"].tolist() == [2.0, 0.5]  # per-row field not expanded: one per sample
    assert mb.first_token.tolist() == [[True, False, True, False, False, False, False, False]]
    back = mb.unpack(mb.tensors["input_ids"], num_rows=3, seq_len=6)
    assert torch.equal(back[0], ids[0]) and torch.equal(back[2], ids[2]) and not back[1].any()
    bad = mask.clone()
    with pytest.raises(PackingError, match="first token"):
        pack_rows({"input_ids": ids, "loss_mask": bad}, [3, 5, 2], [0, 1])


def test_block_mask_matches_per_sample_attention_and_blocks_gradients():
    lengths = [4, 7, 2]
    ids, mask = right_padded(lengths, 8)
    (mb,) = pack_batch({"input_ids": ids}, mask, token_budget=16, pad_to_budget=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, mb.num_tokens, 8, generator=g, requires_grad=True)  # [1, heads, N, d]
    out = F.scaled_dot_product_attention(x, x, x, attn_mask=mb.attention_mask())
    for s in range(len(mb.rows)):
        a, b = int(mb.cu_seqlens[s]), int(mb.cu_seqlens[s + 1])
        ref = F.scaled_dot_product_attention(x[:, :, a:b], x[:, :, a:b], x[:, :, a:b], is_causal=True)
        torch.testing.assert_close(out[:, :, a:b], ref)
    # the output of sample 0 does not depend on any other sample's tokens
    a, b = int(mb.cu_seqlens[0]), int(mb.cu_seqlens[1])
    out[:, :, a:b].sum().backward()
    outside = torch.ones(mb.num_tokens, dtype=torch.bool)
    outside[a:b] = False
    assert x.grad[:, :, outside].abs().max() == 0
    assert not torch.isnan(out).any()  # padding rows attend to themselves, never to nothing


@pytest.fixture(scope="module")
def model():
    cfg = TinyMoeConfig(vocab_size=16, hidden_size=32, num_layers=2, num_heads=2, num_experts=4, top_k=2,
                        expert_intermediate_size=32, max_position_embeddings=64)
    return build_model(cfg, seed=3).eval()


def test_packed_stream_through_the_real_model_equals_unpacked_rows(model):
    lengths = [5, 9, 3, 6]
    ids, mask = right_padded(lengths, 10)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        mbs = pack_batch({"input_ids": ids}, mask, token_budget=12)
        assert len(mbs) == 2
        for mb in mbs:
            out = model(mb.tensors["input_ids"], position_ids=mb.position_ids, attention_mask=mb.valid,
                        segment_ids=mb.seq_ids).logits
            back = mb.unpack(out, num_rows=4, seq_len=10)
            for row in mb.rows:
                n = lengths[row]
                torch.testing.assert_close(back[row, :n], ref[row, :n], rtol=1e-4, atol=1e-5)


def test_row_packing_for_the_trainer_forward(model):
    lengths = [5, 2, 8, 3, 0]
    ids, mask = right_padded(lengths, 8)
    p = plan_packing(mask)
    assert p.pack(ids).shape[0] == 3 and p.attention_mask.sum() == sum(lengths)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        out = model(p.pack(ids), position_ids=p.position_ids, attention_mask=p.attention_mask,
                    segment_ids=p.segment_ids).logits
    back = p.unpack(out)
    for row, n in enumerate(lengths):
        torch.testing.assert_close(back[row, :n], ref[row, :n], rtol=1e-4, atol=1e-5)
        assert not back[row, n:].any()
    logp = torch.arange(1.0, 1 + p.attention_mask.numel()).view(p.attention_mask.shape)
    shifted = p.unpack_shifted(logp)
    assert not shifted[:, 0].any()  # column 0 was predicted across a segment boundary
    torch.testing.assert_close(shifted[:, 1:], p.unpack(logp)[:, 1:])
    assert torch.equal(p.pack(mask, False), p.attention_mask)
    with pytest.raises(PackingError, match="right-padded"):
        plan_packing(torch.tensor([[False, True]]))
