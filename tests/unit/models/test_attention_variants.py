"""The attention block's keyword variants (workers/models/blocks/attention.py) against plain math.

``qkv_bias`` / ``o_bias`` (Qwen2, GPT-OSS), ``sliding_window`` (transformers' rule: a query at index
p sees keys in (p - window, p]), ``scaling`` (Gemma 3's query_pre_attn_scalar) and ``sinks`` (GPT-OSS:
one extra softmax logit per head whose probability is dropped). The reference below is the textbook
formula on an explicit [T, T] score matrix; the block must match it, values and every gradient, in
the paths it runs: the dense masked path (left pads), the mask-free causal path, packed documents,
then, at model level, the dynamic KV cache and the static engine's slots (decode = full forward).
"""
from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from workers.models.blocks import kernels
from workers.models.blocks.attention import Attention, apply_rope, rope_cos_sin
from workers.models.blocks.decoder import Backbone, CausalLM, ForwardContext, dense_mask
from workers.models.blocks.layer import DecoderLayer
from workers.models.blocks.mlp import SwiGLU
from workers.models.blocks.norm import RMSNorm
from workers.models.blocks.varlen import Documents

torch.set_num_threads(1)
H, NH, NKV, HD, T = 16, 4, 2, 8, 9
VARIANTS = {
    "plain": {},
    "biases": dict(qkv_bias=True, o_bias=True),
    "window3": dict(sliding_window=3),
    "window1": dict(sliding_window=1),
    "scaling": dict(scaling=0.7),
    "sinks": dict(sinks=True),
    "all": dict(qkv_bias=True, o_bias=True, sliding_window=4, scaling=0.3, sinks=True, qk_norm_eps=1e-6),
}


def make_attention(seed: int = 0, **kw) -> Attention:
    attn = Attention(hidden_size=H, num_heads=NH, num_kv_heads=NKV, head_dim=HD, rope_theta=100.0, **kw)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(attn.named_parameters(), key=lambda item: item[0] == "sinks"):  # sinks last
            p.copy_(torch.randn(p.shape, generator=g) * (2.0 if p.dim() == 1 else 0.3))
    return attn


def reference(attn: Attention, x: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Explicit scores; ``visible`` [B, T, T] before the window (causal, valid keys, same document)."""
    b, t, _ = x.shape
    q = attn.q_proj(x).view(b, t, NH, HD)
    k = attn.k_proj(x).view(b, t, NKV, HD)
    v = attn.v_proj(x).view(b, t, NKV, HD).transpose(1, 2)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    cos, sin = rope_cos_sin(positions, HD, 100.0, x.dtype)
    q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
    k, v = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
    scale = attn.scaling if attn.scaling is not None else HD ** -0.5
    scores = q @ k.transpose(-1, -2) * scale
    idx = torch.arange(t)
    keep = visible | torch.eye(t, dtype=torch.bool)  # a pad query sees itself (no NaN rows), as the block does
    if attn.sliding_window is not None:
        keep = keep & (idx[None, :] > idx[:, None] - attn.sliding_window)
    scores = scores.masked_fill(~keep[:, None], float("-inf"))
    if attn.sinks is not None:
        full = torch.cat([scores, attn.sinks.view(1, NH, 1, 1).expand(b, NH, t, 1)], dim=-1)
        probs = torch.softmax(full, dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return attn.o_proj((probs @ v).transpose(1, 2).reshape(b, t, -1))


def compare(attn: Attention, ctx: ForwardContext, x: torch.Tensor, visible: torch.Tensor, rows: torch.Tensor) -> None:
    """Values at the ``rows`` positions, then every parameter's gradient of a weighted sum there."""
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(9)) * rows[..., None]
    got = attn(x, ctx)
    grads = torch.autograd.grad((got * w).sum(), list(attn.parameters()))
    want = reference(attn, x, ctx.position_ids, visible)
    ref_grads = torch.autograd.grad((want * w).sum(), list(attn.parameters()))
    torch.testing.assert_close(got[rows], want[rows], rtol=1e-5, atol=1e-5)
    for (name, _), a, b in zip(attn.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def inputs(b: int = 2):
    return torch.randn(b, T, H, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_dense_masked_path_with_left_padding(variant):
    attn, x = make_attention(**VARIANTS[variant]), inputs()
    valid = torch.ones(2, T, dtype=torch.bool)
    valid[1, :3] = False  # left padding: the window counts key indices (transformers' convention)
    pos = torch.arange(T).expand(2, T)
    ctx = ForwardContext(position_ids=pos, valid=valid, mask=dense_mask(valid, T, 0)[:, None], cache=None, past=0)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    compare(attn, ctx, x, causal[None] & valid[:, None, :], valid)
    assert (attn.q_proj.bias is not None) == VARIANTS[variant].get("qkv_bias", False)
    assert (attn.o_proj.bias is not None) == VARIANTS[variant].get("o_bias", False)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_mask_free_causal_path(variant):
    attn, x = make_attention(**VARIANTS[variant]), inputs()
    valid = torch.ones(2, T, dtype=torch.bool)
    ctx = ForwardContext(position_ids=torch.arange(T).expand(2, T), valid=valid, mask=None, cache=None, past=0)
    compare(attn, ctx, x, torch.ones(T, T, dtype=torch.bool).tril()[None].expand(2, T, T), valid)


@pytest.mark.parametrize("variant", ["all", "window3", "sinks"])
def test_packed_documents(variant):
    """Two documents and a pad run in one row: the window restarts with each document."""
    attn, x = make_attention(**VARIANTS[variant]), inputs(1)
    seg = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, -1]])
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0]])
    ctx = ForwardContext(position_ids=pos, valid=seg >= 0, mask=None, cache=None, past=0,
                         docs=Documents.from_segments(seg))
    same = (seg[0, :, None] == seg[0, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    compare(attn, ctx, x, same[None], seg >= 0)


def test_sinks_lower_the_attention_weights_and_a_very_negative_sink_is_none():
    """With sink logits of -1e4 the output is plain attention's; with +1e4 the sink takes all mass (zero output)."""
    attn, x = make_attention(sinks=True), inputs()
    plain = make_attention()
    ctx = ForwardContext(position_ids=torch.arange(T).expand(2, T), valid=torch.ones(2, T, dtype=torch.bool),
                         mask=None, cache=None, past=0)
    with torch.no_grad():
        attn.sinks.fill_(-1e4)
        torch.testing.assert_close(attn(x, ctx), plain(x, ctx))
        attn.sinks.fill_(1e4)
        assert attn(x, ctx).abs().max() < 1e-6


def test_a_window_of_one_sees_only_itself():
    attn, x = make_attention(sliding_window=1), inputs()
    ctx = ForwardContext(position_ids=torch.arange(T).expand(2, T), valid=torch.ones(2, T, dtype=torch.bool),
                         mask=None, cache=None, past=0)
    v = attn.v_proj(x).view(2, T, NKV, HD).repeat_interleave(NH // NKV, 2).reshape(2, T, -1)
    torch.testing.assert_close(attn(x, ctx), attn.o_proj(v))
    with pytest.raises(ValueError, match="sliding_window"):
        make_attention(sliding_window=0)


class TinyLM(CausalLM):
    """Two layers: a windowed one with every option, and a full one (the interleaving Gemma 3 / GPT-OSS use)."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(vocab_size=40, hidden_size=H, num_layers=2, tie_word_embeddings=False,
                                            init_std=0.3)
        layers = [DecoderLayer(hidden_size=H, rms_norm_eps=1e-6, mlp=SwiGLU(H, 24),
                               attention=make_attention(i, **kw)) for i, kw in enumerate([VARIANTS["all"], {}])]
        self.model = Backbone(nn.Embedding(40, H), layers, RMSNorm(H, 1e-6))
        self.make_head()


@pytest.fixture(scope="module")
def lm():
    return TinyLM().init_weights(3).eval()


IDS = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(4))


def test_model_paths_agree_left_pad_and_fast_path(lm, monkeypatch):
    with torch.no_grad():
        ref = lm(IDS).logits
        monkeypatch.setattr(kernels, "FAST_PATH_ON_CPU", True)
        torch.testing.assert_close(lm(IDS).logits, ref, rtol=1e-5, atol=1e-5)
        monkeypatch.setattr(kernels, "FAST_PATH_ON_CPU", False)
        padded = torch.cat([torch.zeros(2, 3, dtype=torch.long), IDS], dim=1)
        mask = torch.ones(2, 15, dtype=torch.long)
        mask[:, :3] = 0
        pos = (mask.cumsum(1) - 1).clamp_min(0)
        torch.testing.assert_close(lm(padded, attention_mask=mask, position_ids=pos).logits[:, 3:], ref,
                                   rtol=1e-5, atol=1e-5)


def test_dynamic_cache_decode_equals_the_full_forward(lm):
    with torch.no_grad():
        ref = lm(IDS).logits
        cache = lm.new_cache()
        steps = [lm(IDS[:, :5], cache=cache).logits]
        steps += [lm(IDS[:, i:i + 1], cache=cache).logits for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), ref, rtol=1e-5, atol=1e-5)


def test_static_slots_decode_equals_the_full_forward(lm):
    from workers.inference.embedded.static_cache import StaticKVCache

    with torch.no_grad():
        ref = lm(IDS).logits
        cache = StaticKVCache(lm, num_slots=3, max_len=16, device="cpu", dtype=torch.float32)
        cache.use(torch.tensor([2, 0]), prefix=False)  # a prefill gathers its slots
        steps = [lm(IDS[:, :5], position_ids=torch.arange(5).expand(2, 5), cache=cache).logits]
        for i in range(5, 12):
            steps.append(lm(IDS[:, i:i + 1], position_ids=torch.full((2, 1), i), cache=cache).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), ref, rtol=1e-5, atol=1e-5)


def test_packed_rows_equal_separate_rows(lm):
    with torch.no_grad():
        a, b = lm(IDS[:1, :7]).logits, lm(IDS[1:, :5]).logits
        seg = torch.tensor([[0] * 7 + [1] * 5])
        pos = torch.tensor([list(range(7)) + list(range(5))])
        packed = lm(torch.cat([IDS[:1, :7], IDS[1:, :5]], dim=1), segment_ids=seg, position_ids=pos).logits
    torch.testing.assert_close(packed, torch.cat([a, b], dim=1), rtol=1e-5, atol=1e-5)


def _ulysses_worker(rank: int, world: int, port: int, heads: int, out: str) -> None:
    """This rank's chunk through Ulysses (heads % cp == 0) or the gathered keys (heads % cp != 0)."""
    import torch.distributed as dist

    from workers.models.blocks import ulysses
    from tests.netutil import gloo_dims

    torch.set_num_threads(1)
    dims = gloo_dims(rank, world, port, cp=world)
    try:
        q, k, v, sinks, seg = _cp_inputs(heads)
        valid = seg >= 0
        cp = ulysses.SeqShard(group=dims.get_group("cp"), size=world, rank=rank, valid=valid, segment_ids=seg)
        docs = Documents.from_segments(seg)
        local = [cp.local(x, dim=2).detach().requires_grad_() for x in (q, k, v)]
        res = {}
        for name, kw in {"causal": {}, "docs": {"docs": docs}}.items():
            o = ulysses.attend(*local, None, cp, 0.4, window=3, sinks=sinks, **kw)
            grads = torch.autograd.grad(o.sum(), [*local, sinks])
            res[name] = (o.detach(), [g.detach() for g in grads])
        torch.save(res, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _cp_inputs(heads: int):
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, heads, 8, 4, generator=g) for _ in range(3))
    sinks = torch.randn(heads, generator=g).requires_grad_()
    return q, k, v, sinks, torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1]])


@pytest.mark.parametrize("heads", [2, 3], ids=["ulysses", "gathered"])
def test_context_parallel_paths_take_the_window_and_sinks(tmp_path, heads):
    """cp = 2 on gloo: each rank's outputs and gradients (q/k/v of its chunk, its share of the sink
    gradient) equal the one-process ``kernels.attend`` of the whole rows, plain causal and packed."""
    from tests.netutil import run_ranks

    out = str(tmp_path / "cp")
    run_ranks(_ulysses_worker, 2, (heads, out), what=f"ulysses window+sinks heads={heads}")
    got = [torch.load(f"{out}.{r}") for r in range(2)]
    q, k, v, sinks, seg = _cp_inputs(heads)
    for name in ("causal", "docs"):
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        docs = Documents.from_segments(seg) if name == "docs" else None
        o = kernels.attend(*full, None, 0.4, docs=docs, window=3, sinks=sinks)
        want = torch.autograd.grad(o.sum(), [*full, sinks])
        torch.testing.assert_close(torch.cat([g[name][0] for g in got], dim=2), o.detach())
        for i in range(3):  # q, k, v: each rank holds its chunk's gradient
            torch.testing.assert_close(torch.cat([g[name][1][i] for g in got], dim=2), want[i], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[0][name][1][3] + got[1][name][1][3], want[3], rtol=1e-5, atol=1e-6)


def test_the_gpu_varlen_branches_get_flash_attentions_window_size(monkeypatch):
    """On CUDA (bf16) a windowed layer's mask-free paths run torch's varlen kernel with
    ``window_size=(window - 1, 0)``; checked on CPU with a stand-in kernel reading that argument the
    way flash attention does (keys i - left .. i), against the masked path."""
    from workers.models.blocks import masking, varlen

    seen = []

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size):
        seen.append(window_size)
        left = window_size[0] if window_size[0] >= 0 else None
        out = []
        for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            mask = masking.causal_mask(b - a, q.device, None if left is None else left + 1)
            x = [t[a:b].transpose(0, 1) for t in (q, k, v)]
            out.append(torch.nn.functional.scaled_dot_product_attention(*x, attn_mask=mask, scale=scale).transpose(0, 1))
        return torch.cat(out)

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 7, 4, generator=g) for _ in range(3))
    seg = torch.tensor([[0, 0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0, 0]])
    want = [kernels.attend(q, k, v, None, 0.5, window=3), kernels.attend(q, k, v, None, 0.5, Documents.from_segments(seg), window=3)]
    monkeypatch.setattr(varlen, "_VARLEN", fake_varlen)
    monkeypatch.setitem(varlen._VARLEN_CAUSAL, "window_size", (-1, 0))
    monkeypatch.setattr(varlen, "varlen_ok", lambda q, v, window=None: True)
    monkeypatch.setattr(kernels, "varlen_ok", lambda q, v, window=None: True)
    got = [kernels.attend(q, k, v, None, 0.5, window=3), kernels.attend(q, k, v, None, 0.5, Documents.from_segments(seg), window=3)]
    assert seen == [(2, 0), (2, 0)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("window", [1, 3, 5])
def test_windowed_attention_in_query_blocks_equals_the_banded_mask(window, monkeypatch):
    """The CPU / float32 windowed path (varlen.windowed_sdpa: query blocks against their band of keys,
    no [T, T] mask) with blocks of 4 over 11 tokens: every block boundary equals one masked SDPA."""
    from workers.models.blocks import masking, varlen

    monkeypatch.setattr(varlen, "WINDOW_BLOCK", 4)
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 3, 11, 4, generator=g, requires_grad=True) for _ in range(3))
    sinks = torch.randn(3, generator=g, requires_grad=True)
    got = varlen.windowed_sdpa(q, k, v, 0.5, window, sinks)
    mask = masking.causal_mask(11, "cpu", window)[None, None]
    q1, k1, v1, m1 = masking.with_sinks(q, k, v, mask, sinks, 0.5)
    want = torch.nn.functional.scaled_dot_product_attention(q1, k1, v1, attn_mask=m1, scale=0.5)
    torch.testing.assert_close(got, want)
    a = torch.autograd.grad(got.square().sum(), (q, k, v, sinks))
    b = torch.autograd.grad(want.square().sum(), (q, k, v, sinks))
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)

