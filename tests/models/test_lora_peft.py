"""Our LoRA (workers/models/lora) against peft 0.21 on transformers-built tiny checkpoints.

Each case: transformers builds the model (dense Llama; Qwen3-MoE with a dense layer), ours loads
its checkpoint, LoRA goes on attention, MLP and the routed experts (peft's ``target_parameters`` on
transformers' stacked experts), adapters get random non-zero values (B is zero at init, which would
hide a wrong B), our adapter is written in the published format (workers/weights/lora_format.py) and
``PeftModel.from_pretrained`` loads it onto the transformers model. Then: logits equal; the
gradients of a scalar loss on every adapter factor equal peft's (read back through the format's
reader); the frozen base gets no gradient. ``shared_outer`` is published expanded, so the same
comparison checks it too.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.models.parity import hf_reference, load_into, rel_err, scalar_loss
from workers.common.config.lora import LoraConfig
from workers.common.registry import MODELS
from workers.models.lora.inject import apply_lora, gather_adapter, init_tensors, is_lora_name
from workers.models.llama.config import LlamaConfig
from workers.models.qwen3_moe.config import Qwen3MoeConfig
from workers.weights.lora_format import from_peft_state, write_adapter

peft = pytest.importorskip("peft", reason="peft is in the dev extra (pip install -e '.[dev]')")

IDS = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
DENSE = LlamaConfig(name="t", vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    dense_intermediate_size=48, max_position_embeddings=64)
MOE = Qwen3MoeConfig(name="t", vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     num_experts=4, top_k=2, expert_intermediate_size=16, dense_intermediate_size=24,
                     mlp_only_layers=[0], max_position_embeddings=64)
CASES = {"llama": ("llama", DENSE, "per_expert"), "qwen3_moe": ("qwen3_moe", MOE, "per_expert"),
         "qwen3_moe-shared_outer": ("qwen3_moe", MOE, "shared_outer")}


def _hf_config(family, cfg):
    import transformers

    spec = MODELS.get(family)
    kw = spec.to_hf_config(cfg)
    return getattr(transformers, kw["architectures"][0].replace("ForCausalLM", "Config"))(**kw)


@pytest.fixture(params=sorted(CASES), scope="module")
def case(request, tmp_path_factory):
    family, cfg, mode = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    hf, d = hf_reference(_hf_config(family, cfg), tmp)
    ours = load_into(MODELS.get(family).build(cfg), d)
    lcfg = LoraConfig(rank=4, alpha=8.0, experts=mode)
    apply_lora(ours, lcfg, family=family)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        state = dict(ours.named_parameters())
        for name, t in init_tensors(ours, seed=0):  # A as initialised; B random (zero would hide it)
            state[name].copy_(t if "lora_A" in name.split(".") else 0.1 * torch.randn(t.shape, generator=g))
    adapter_dir = write_adapter(tmp / "adapter", gather_adapter(ours, lcfg, to_hf=MODELS.get(family).to_hf,
                                                                base_model=str(d)))
    peft_model = peft.PeftModel.from_pretrained(hf, adapter_dir, is_trainable=True).eval()
    return request.param, ours, peft_model


def test_logits_match_peft(case):
    name, ours, pm = case
    with torch.no_grad():
        want, got = pm(input_ids=IDS).logits, ours(IDS).logits
    assert rel_err(got, want) < 1e-5, name
    base = pm.get_base_model()
    with pm.disable_adapter(), torch.no_grad():  # the adapter changes the logits: not a no-op comparison
        assert rel_err(base(input_ids=IDS).logits, want) > 1e-3


def test_adapter_grads_match_peft_and_base_gets_none(case):
    name, ours, pm = case
    for m in (ours, pm):
        m.zero_grad(set_to_none=True)
    scalar_loss(ours(IDS).logits).backward()
    scalar_loss(pm(input_ids=IDS).logits).backward()
    assert all(p.grad is None for n, p in ours.named_parameters() if not is_lora_name(n))
    assert all(not p.requires_grad for n, p in ours.named_parameters() if not is_lora_name(n))
    peft_grads = {k.replace(".default", ""): p.grad for k, p in pm.named_parameters() if "lora_" in k}
    want = from_peft_state(peft_grads, {"r": 4, "target_parameters": pm.peft_config["default"].target_parameters})
    mods = dict(ours.named_modules())
    checked = 0
    for target, (ga, gb) in want.items():
        path, _, stack = target.rpartition(".")
        if isinstance(mods.get(target), torch.nn.Linear):
            a, b = mods[target].lora_A.grad, mods[target].lora_B.grad
        else:
            a, b = mods[path].lora_A[stack].grad, mods[path].lora_B[stack].grad
            if a.dim() == 2:  # shared_outer: the shared factor's gradient is the sum over experts
                ga = ga.sum(0)
            if b.dim() == 2:
                gb = gb.sum(0)
        assert rel_err(a, ga) < 1e-4 and rel_err(b, gb) < 1e-4, (name, target)
        checked += 1
    assert checked == len(list(m for m in mods.values() if hasattr(m, "lora_A"))) + sum(
        len(getattr(m, "lora_A")) - 1 for m in mods.values() if isinstance(getattr(m, "lora_A", None), torch.nn.ParameterDict))


def test_router_is_not_adapted():
    ours = MODELS.get("qwen3_moe").build(dataclasses.replace(MOE))
    apply_lora(ours, LoraConfig(rank=2), family="qwen3_moe")
    assert not any(is_lora_name(n) for n, _ in ours.named_parameters() if ".gate." in n)
    assert not ours.model.layers[1].mlp.gate.weight.requires_grad
