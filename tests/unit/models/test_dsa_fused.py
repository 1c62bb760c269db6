"""DSA's fused sparse-latent attention (workers/models/blocks/dsa_fused.py) under Triton's CPU
interpreter (``TRITON_INTERPRET=1``, in a subprocess: the flag is read when a kernel is defined):
its output and the gradients of the absorbed queries and of the latent cache equal the torch
reference's, with the indices the indexer produces (causal ``-1`` padding, a row with nothing
chosen, K not a multiple of the key block, heads not a multiple of the head block); and a tiny
GLM-5 with ``model.dsa_attention_kernel=auto`` (the kernel) gives the ``torch`` path's logits and
parameter gradients on plain, left-padded and packed rows."""
from __future__ import annotations

import dataclasses
import textwrap

import pytest

from tests.helpers.triton_interpreter import assert_ok_under_interpreter
from workers.common.config.ranges import ConfigError, check_fields
from workers.models.blocks.dsa_sparse import attention_chunk

KERNEL = textwrap.dedent("""
    import torch
    from workers.models.blocks.dsa_fused import fused_applies, latent_reference, sparse_latent_attention
    assert fused_applies(torch.zeros(1))
    g = torch.Generator().manual_seed(0)

    def case(b, h, t, s, k, r, dr, first, none_chosen=()):
        q = torch.randn(b, h, t, r + dr, generator=g)
        entry = torch.randn(b, s, r + dr, generator=g)
        score = torch.randn(b, t, s, generator=g)  # the indexer's causal choice: query i sees keys <= first + i
        future = torch.arange(s)[None, :] > (first + torch.arange(t))[:, None]
        vals, idx = score.masked_fill(future, float("-inf")).topk(min(k, s), -1)
        chosen = torch.where(vals > float("-inf"), idx, -1).to(torch.int32)
        assert (chosen < 0).any() or first
        for bb, tt in none_chosen:
            chosen[bb, tt] = -1  # a padded query: nothing visible
        w = torch.randn(b, h, t, r, generator=g)
        got = []
        for fn in (latent_reference, sparse_latent_attention):
            qq, ee = q.clone().requires_grad_(), entry.clone().requires_grad_()
            out = fn(qq, ee, chosen, 0.3, r)
            (out * w).sum().backward()
            got.append((out.detach(), qq.grad, ee.grad))
        for want, have, name in zip(*got, ("out", "dq", "dentry")):
            err = float((have - want).abs().max())
            assert err <= 1e-5 * float(want.abs().max()) + 1e-6, (name, err)
        assert float(got[0][2].abs().sum()) > 0

    case(1, 3, 20, 20, 8, 16, 8, 0)  # K 8 < T: causal -1 in the first rows
    case(2, 2, 9, 30, 19, 32, 16, 21, none_chosen=((1, 3),))  # 19 keys: a partial key block; a row of -1
    case(1, 17, 6, 6, 6, 16, 8, 0)  # 17 heads: two head blocks, the second nearly empty
    print("ok")
""")


def test_kernel_equals_the_torch_reference_forward_and_backward():
    assert_ok_under_interpreter(KERNEL)


MODEL = textwrap.dedent("""
    import dataclasses
    import torch
    from workers.common.registry import MODELS
    from workers.models.glm_moe_dsa.config import GlmMoeDsaConfig
    from workers.trainer.packing import plan_packing
    torch.set_num_threads(1)
    base = GlmMoeDsaConfig(name="t", vocab_size=64, hidden_size=32, num_layers=2, num_heads=3, num_experts=4, top_k=2,
        expert_intermediate_size=16, num_shared_experts=1, num_dense_layers=1, dense_intermediate_size=32,
        num_expert_groups=2, topk_groups=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=8, num_indexer_heads=2, indexer_head_dim=8, index_topk=5, dsa_chunk_tokens=4, init_seed=7,
        indexer_pattern="FS")

    def run(kernel, ids, **kw):
        cfg = dataclasses.replace(base, dsa_attention_kernel=kernel)
        model = MODELS.get(cfg.family).init(cfg, torch.float32)
        logits = model(ids, **kw).logits
        (logits.log_softmax(-1) * torch.randn(logits.shape, generator=torch.Generator().manual_seed(9))).sum().backward()
        return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    ids = torch.randint(1, 64, (3, 11), generator=torch.Generator().manual_seed(1))
    left = torch.ones(3, 11, dtype=torch.bool)
    left[1, :3] = False  # left padding: padded queries see nothing (every index -1)
    lengths = torch.tensor([9, 4, 6])
    p = plan_packing(torch.arange(11)[None] < lengths[:, None])
    packed = dict(position_ids=p.position_ids, attention_mask=p.attention_mask, segment_ids=p.segment_ids)
    for x, kw in ((ids, {}), (ids, {"attention_mask": left}), (p.pack(ids), packed)):
        (got, g), (want, gw) = run("auto", x, **kw), run("torch", x, **kw)
        valid = kw.get("attention_mask", torch.ones(x.shape, dtype=torch.bool)).bool()
        torch.testing.assert_close(got[valid], want[valid], rtol=1e-5, atol=1e-5)
        assert g.keys() == gw.keys() and "model.layers.0.self_attn.kv_b_proj.weight" in g
        for name in gw:
            err = float((g[name] - gw[name]).abs().max())
            assert err <= 1e-4 * float(gw[name].abs().max()) + 1e-7, (name, err)
    print("ok")
""")


def test_tiny_glm5_with_the_kernel_equals_the_torch_path():
    assert_ok_under_interpreter(MODEL)


def test_the_switch_takes_auto_or_torch_only():
    from benchmarks.long_context_dsa import TINY_GLM

    check_fields(dataclasses.replace(TINY_GLM, dsa_attention_kernel="torch"), "model")
    with pytest.raises(ConfigError, match=r"model.dsa_attention_kernel='cuda' .*\['auto', 'torch'\]"):
        check_fields(dataclasses.replace(TINY_GLM, dsa_attention_kernel="cuda"), "model")


def test_fused_chunks_hold_thousands_of_queries_at_glm5_widths():
    torch_path = attention_chunk(256, 2048, 576, 64, 2)
    fused = attention_chunk(256, 2048, 576, 64, 2, fused=True)
    assert torch_path < 512 and 2048 <= fused <= 8192  # nothing per key: a 131k row in a few dozen chunks
