"""The dense path of the model (a pretrained Llama such as SmolLM2 runs on it): grouped-query
attention, tied embeddings, dense SwiGLU layers with HF Llama names, KV-cached decode and the
embedded engine, each checked against an independent computation of the same function."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from workers.inference.embedded.engine import GenRequest, InferenceEngine
from workers.models.llama.config import LlamaConfig
from workers.models.tiny_moe.model import KVCache, build_model

torch.set_num_threads(1)
CFG = LlamaConfig(vocab_size=40, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                    dense_intermediate_size=96, tie_word_embeddings=True, max_position_embeddings=64,
                    rope_theta=100000.0, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, seed=5).eval()


def test_state_dict_has_llama_names_and_no_lm_head(model):
    names = set(model.state_dict())
    assert "lm_head.weight" not in names, "tied: the embedding is stored once"
    assert "model.layers.0.mlp.gate_proj.weight" in names and not any(".experts." in n or ".gate.weight" in n for n in names)
    assert model.state_dict()["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 16, 64)  # kv heads x head dim


def _as_mha(model) -> torch.nn.Module:
    """The same function with every kv head repeated for its query heads (plain multi-head attention)."""
    full = build_model(dataclasses.replace(CFG, num_kv_heads=0), seed=0)
    state = dict(model.state_dict())
    group = CFG.num_heads // CFG.kv_heads
    for name in list(state):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            w = state[name].view(CFG.kv_heads, CFG.head_dim, CFG.hidden_size)
            state[name] = w.repeat_interleave(group, dim=0).reshape(CFG.hidden_size, CFG.hidden_size)
    full.load_state_dict(state)
    return full.eval()


@torch.no_grad()
def test_grouped_query_attention_equals_repeated_heads(model):
    ids = torch.randint(0, CFG.vocab_size, (3, 11), generator=torch.Generator().manual_seed(1))
    a, b = model(ids).logits, _as_mha(model)(ids).logits
    assert torch.allclose(a, b, atol=1e-5), float((a - b).abs().max())


@torch.no_grad()
def test_tied_logits_are_the_embedding_transposed(model):
    ids = torch.tensor([[1, 2, 3, 4]])
    hidden = {}
    hook = model.model.norm.register_forward_hook(lambda m, i, o: hidden.update(h=o))
    try:
        logits = model(ids).logits
    finally:
        hook.remove()
    assert torch.allclose(logits, hidden["h"] @ model.model.embed_tokens.weight.T, atol=1e-6)


def test_tied_embedding_gets_gradient_from_both_uses(model):
    m = build_model(CFG, seed=5)
    ids = torch.tensor([[3, 7, 9]])
    m(ids).logits[0, -1, 11].backward()
    g = m.model.embed_tokens.weight.grad
    assert g[11].abs().sum() > 0, "row 11 is only used as an output row: its gradient comes from the head"
    assert g[3].abs().sum() > 0, "row 3 is only used as an input row"
    assert g[20].abs().sum() == 0


@torch.no_grad()
def test_dense_output_has_empty_routing(model):
    out = model(torch.tensor([[1, 2, 3]]))
    assert out.routed_experts.shape == (1, 3, 0, 0) and out.expert_load.numel() == 0 and float(out.aux_loss) == 0.0


@torch.no_grad()
def test_kv_cache_decode_matches_full_forward(model):
    ids = torch.randint(0, CFG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    full = model(ids).logits
    cache = KVCache(CFG.num_layers)
    steps = [model(ids[:, :5], cache=cache).logits]
    for t in range(5, 9):
        steps.append(model(ids[:, t:t + 1], position_ids=torch.full((2, 1), t), cache=cache).logits)
    assert cache.keys[0].shape[1] == CFG.kv_heads, "the cache holds kv heads only"
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)


def test_engine_greedy_matches_reference_decode(model):
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9], [4]]
    engine = InferenceEngine(model, max_batch_size=2, seed=0).start()
    try:
        outs = engine.generate([GenRequest(rid=str(i), input_ids=p, max_new_tokens=6, temperature=0.0)
                                for i, p in enumerate(prompts)])
    finally:
        engine.shutdown()
    for p, out in zip(prompts, outs):
        seq = list(p)
        with torch.no_grad():
            for _ in range(6):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        assert out.output_ids == seq[len(p):]
