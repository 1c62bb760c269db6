"""``lora_publish.init_in_place``: the path every fully built model takes into LoRA mode (a
``model.pretrained`` checkpoint such as SmolLM2's, a family's own plan, the GPU step benchmark).

Why a test of its own: the meta-device path (``add_adapters`` + ``materialize``) is what the
integration runs exercise; this one once read the model's parameter names before the adapters
existed and failed with a KeyError on the first adapter, so SmolLM2 could not run LoRA at all.
"""
from __future__ import annotations

import torch

from tests.helpers.configs import compose
from workers.common.registry import MODELS
from workers.models.lora.inject import is_lora_name
from workers.trainer import lora_publish


def test_init_in_place_adapts_a_built_model_and_keeps_its_outputs():
    cfg = compose(["model=tiny_dense", "trainer.lora.rank=4", "trainer.lr=3e-3"])
    model = MODELS.get(cfg.model.family).init(cfg.model, torch.float32)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    lora_publish.init_in_place(cfg, model)
    adapters = {n: p for n, p in model.named_parameters() if is_lora_name(n)}
    per_layer = 7  # q, k, v, o, gate, up, down: each an A and a B
    assert len(adapters) == 2 * per_layer * cfg.model.num_layers
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(adapters)  # the base is frozen
    for name, p in adapters.items():
        assert p.dtype == torch.float32
        if name.endswith("lora_B"):
            assert not p.any(), name  # B = 0: step 0's policy is the base
        else:
            assert p.abs().sum() > 0, name  # A drawn (PEFT's kaiming-uniform)
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=0, atol=0)
