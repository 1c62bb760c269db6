"""A GPU engine's parameters in one storage per dtype (workers/inference/embedded/param_arena.py).

Packing (forced on CPU here, as a GPU engine packs) must change nothing but where the bytes live: the
same parameter objects (tied ones still one), names, values and forward; and weight updates through
patches must still give the trainer's weights bit for bit, as one staged group, with the layout kept.
"""
from __future__ import annotations

import pytest
import torch

import workers.inference.embedded.param_arena as arena
import workers.weights.delta.apply as apply_mod
from tests.unit.inference.test_weight_swap import CFG as MOE_CFG
from tests.unit.inference.test_weight_swap import _bits, _steps
from workers.inference.embedded.engine import InferenceEngine
from workers.models.llama.config import LlamaConfig
from workers.models.tiny_moe.model import build_model

torch.set_num_threads(1)
TIED = LlamaConfig(vocab_size=40, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   dense_intermediate_size=96, tie_word_embeddings=True, max_position_embeddings=64)


@pytest.fixture(autouse=True)
def _pack_on_cpu(monkeypatch):
    monkeypatch.setattr(arena, "PACK_ON_CPU", True)


@pytest.mark.parametrize("cfg", [MOE_CFG, TIED], ids=["tiny_moe_expert_stacks", "llama_tied_embeddings"])
def test_packing_changes_where_the_bytes_live_and_nothing_else(cfg):
    model = build_model(cfg, seed=3).eval()
    params = dict(model.named_parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([[1, 5, 7, 2]])
    with torch.no_grad():
        ref = model(ids).logits
    assert arena.storages(model) == len(params) > 1

    packed = arena.pack_parameters(model)
    assert packed == {"float32": len(params)} and arena.storages(model) == 1
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    after = model.state_dict()
    assert list(after) == list(before) and _bits(after) == _bits(before)
    base = next(model.parameters()).untyped_storage().data_ptr()  # a GPU allocation itself is 512-byte aligned
    for p in model.parameters():
        assert p.is_contiguous() and (p.data_ptr() - base) % arena.ALIGN_BYTES == 0
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)
    if cfg.tie_word_embeddings:  # the head reads the embedding's parameter, which moved with it
        assert model.lm_head is None and "model.embed_tokens.weight" in params


def test_a_packed_engine_applies_patches_bit_exactly_as_one_group(tmp_path, monkeypatch):
    versions = _steps(tmp_path, 3)
    model = build_model(MOE_CFG, seed=1)
    arena.pack_parameters(model)
    engine = InferenceEngine(model, max_batch_size=2, seed=0)
    engine.update_weights_from_disk(str(tmp_path / "step_000000"), 0)  # the anchor: a full step
    groups = []
    real = apply_mod._groups
    monkeypatch.setattr(apply_mod, "_groups", lambda *a, **k: groups.append(real(*a, **k)) or groups[-1])
    for v in (1, 2, 3):
        engine.update_weights_from_disk(str(tmp_path / f"step_{v:06d}"), v)
    assert [len(g) for g in groups] == [1, 1, 1]  # every patch staged as one storage's group
    assert arena.storages(engine.model) == 1  # updates write in place: the layout stays
    assert _bits(engine.model.state_dict()) == _bits(versions[3])


def test_a_write_through_the_buffer_does_not_move_a_parameters_version_counter():
    """Why an fp8 engine is not packed (startup.build_engine): its re-quantization watches each weight's
    version counter (fp8.py), which a patch written through the shared buffer leaves alone."""
    model = build_model(TIED, seed=3)
    arena.pack_parameters(model)
    p = model.model.layers[1].mlp.down_proj.weight
    seen = p._version
    flat = next(model.parameters()).detach()
    flat.as_strided((1,), (1,), p.storage_offset()).fill_(1.0)  # through another parameter's view
    assert p.reshape(-1)[0] == 1.0 and p._version == seen
