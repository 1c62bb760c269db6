"""glm_moe_dsa (GLM-5) against transformers' GlmMoeDsaForCausalLM on tiny configs.

Same checks as deepseek_v3 (tests/models/test_parity_deepseek_v3.py), with the DeepSeek Sparse
Attention indexer narrowing attention: ``index_topk`` is smaller than the sequences, so each
query's choice of keys matters, including under the KV cache (engine decode vs ``generate``) and
with ``shared`` layers reusing the previous full layer's choice.
"""
from __future__ import annotations

import pytest
import torch

from tests.models.parity import (assert_engine_greedy_matches_hf, assert_grads_match, assert_logits_match,
                                 assert_router_replay, rel_err)
from tests.models.test_parity_deepseek_v3 import BASE, YARN, hf_model, ours_from
from workers.common.registry import MODELS

GLM = {**{k: v for k, v in BASE.items() if k != "num_nextn_predict_layers"},
       "index_topk": 4, "index_head_dim": 16, "index_n_heads": 4}
VARIANTS = {
    "every_layer_full_plain_rope": dict(rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
    "shared_layer_yarn": dict(index_topk_pattern="FFS", rope_parameters=YARN, max_position_embeddings=16384),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_grads_replay_and_generation_match_transformers(variant, tmp_path):
    hf, d = hf_model({**GLM, **VARIANTS[variant]}, tmp_path, family="glm_moe_dsa")
    ours, cfg = ours_from(hf, d, family="glm_moe_dsa")
    assert cfg.indexer_pattern == ("FFS" if "shared" in variant else "")
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(1))
    assert_logits_match(ours, hf, ids)
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, :5] = 0
    assert_logits_match(ours, hf, ids, attention_mask=mask)
    assert_grads_match(ours, hf, ids)
    assert_router_replay(ours, ids)
    assert_engine_greedy_matches_hf(ours, hf, [[1, 2, 3, 4, 5, 6], [5, 6, 7, 8, 9, 10, 11], [4]], max_new_tokens=6)


def test_the_indexer_restricts_attention(tmp_path):
    """With index_topk below the sequence length the logits differ from dense MLA on the same weights
    (so the parity above checks the sparse choice, not only the dense part)."""
    hf, d = hf_model({**GLM, **VARIANTS["every_layer_full_plain_rope"]}, tmp_path, family="glm_moe_dsa")
    ours, cfg = ours_from(hf, d, family="glm_moe_dsa")
    ids = torch.randint(0, 96, (1, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        sparse = ours(ids).logits
        for layer in ours.model.layers:
            layer.self_attn.indexer.topk = 64
        dense = ours(ids).logits
    # the first index_topk queries see every key anyway (equal up to the order of the float sums)
    torch.testing.assert_close(sparse[:, :4], dense[:, :4], rtol=1e-5, atol=1e-6)
    assert rel_err(sparse, dense) > 1e-3


def test_config_round_trips_through_transformers(tmp_path):
    from transformers import GlmMoeDsaConfig as HfConfig

    spec = MODELS.get("glm_moe_dsa")
    cfg = spec.config(name="t", **spec.from_hf_config(HfConfig(**GLM, index_topk_pattern="FFS").to_dict()))
    hf = HfConfig(**spec.to_hf_config(cfg))
    assert hf.indexer_types == ["full", "full", "shared"] and hf.index_topk == 4
    assert spec.config(name="t", **spec.from_hf_config(hf.to_dict())) == cfg
    with pytest.raises(ValueError, match="mlp_layer_types"):
        spec.from_hf_config({**hf.to_dict(), "mlp_layer_types": ["sparse"] * 3})


def test_continuous_batching_keeps_latent_and_indexer_caches_aligned(tmp_path):
    """Rows finish at different steps (KVCache.select + trim_left) and a waiting prompt joins the running
    batch (merge, left-padding both the latent and the indexer-key slots): every row still decodes exactly
    transformers' greedy tokens."""
    from workers.inference.embedded.engine import GenRequest, InferenceEngine

    hf, d = hf_model({**GLM, **VARIANTS["shared_layer_yarn"]}, tmp_path, family="glm_moe_dsa")
    ours, _ = ours_from(hf, d, family="glm_moe_dsa")
    jobs = [([1, 2, 3, 4, 5, 6, 7, 8], 2), ([9, 10, 11], 8), ([12, 13, 14, 15, 16], 6)]
    engine = InferenceEngine(ours, max_batch_size=2, seed=0).start()
    try:
        outs = engine.generate([GenRequest(rid=str(i), input_ids=p, max_new_tokens=n, temperature=0.0)
                                for i, (p, n) in enumerate(jobs)])
    finally:
        engine.shutdown()
    for (p, n), out in zip(jobs, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.output_ids == ref[0, len(p):].tolist(), p


def test_mask_free_fast_path_matches_the_reference_path(tmp_path, monkeypatch):
    """The GPU fast path (no mask tensor: causal SDPA, the indexer builds its own causal visibility) computes
    the reference path's logits; run on CPU through kernels.FAST_PATH_ON_CPU."""
    from workers.models.blocks import kernels

    hf, d = hf_model({**GLM, **VARIANTS["shared_layer_yarn"]}, tmp_path, family="glm_moe_dsa")
    ours, _ = ours_from(hf, d, family="glm_moe_dsa")
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = ours(ids).logits
        monkeypatch.setattr(kernels, "FAST_PATH_ON_CPU", True)
        fast = ours(ids).logits
    assert rel_err(fast, ref) <= 1e-5
