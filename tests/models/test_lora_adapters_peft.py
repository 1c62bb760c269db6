"""Several LoRA adapters on one base (issue 44 item 5; workers/models/lora/rows.py): the per-token
masked forward equals each adapter run on its own, gradients stay with each row's adapter, and the
published per-adapter directories load through ``peft.PeftModel.from_pretrained`` onto the transformers
model with our logits."""
from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys

import pytest
import torch

from tests.models.parity import hf_reference, load_into, rel_err
from workers.common.config.lora import LoraConfig
from workers.common.registry import MODELS
from workers.models.lora.inject import apply_lora, gather_adapter, init_tensors, is_lora_name, split_adapters
from workers.models.lora.rows import rows_of
from workers.models.llama.config import LlamaConfig
from workers.weights.lora_format import write_adapter

NAMES = ["even", "odd", "third"]
IDS = torch.randint(0, 96, (5, 9), generator=torch.Generator().manual_seed(0))
ROWS = torch.tensor([0, 2, 1, 0, 2])  # each row's adapter
DENSE = LlamaConfig(name="t", vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    dense_intermediate_size=48, max_position_embeddings=64)


def _several(seed: int = 1):
    """Our llama with 3 adapters side by side (A as initialised, B random: zero would hide them)."""
    model = MODELS.get("llama").build(DENSE)
    lcfg = LoraConfig(rank=4, alpha=8.0, adapters=list(NAMES))
    apply_lora(model, lcfg, family="llama")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        state = dict(model.named_parameters())
        for name, t in init_tensors(model, seed=0):
            state[name].copy_(t if "lora_A" in name.split(".") else 0.1 * torch.randn(t.shape, generator=g))
    return model, lcfg


def _single(several, lcfg, index: int):
    """A one-adapter model holding adapter ``index`` of ``several`` (same base)."""
    one = MODELS.get("llama").build(DENSE)
    one.load_state_dict({k: v for k, v in several.state_dict().items() if not is_lora_name(k)}, strict=False)
    apply_lora(one, dataclasses.replace(lcfg, adapters=[]), family="llama")
    r = lcfg.rank
    with torch.no_grad():
        mine = dict(several.named_parameters())
        for name, p in one.named_parameters():
            if name.endswith("lora_A"):
                p.copy_(mine[name][index * r:(index + 1) * r])
            elif name.endswith("lora_B"):
                p.copy_(mine[name][:, index * r:(index + 1) * r])
    return one


def test_each_row_gets_its_own_adapter_and_gradient():
    model, lcfg = _several()
    rows_of(model).use(ROWS[:, None].expand(IDS.shape))
    logits = model(IDS).logits
    logits.square().mean().backward()
    for i in range(len(NAMES)):
        one = _single(model, lcfg, i)
        mine = ROWS == i
        want = one(IDS[mine]).logits
        assert rel_err(logits[mine], want) < 1e-6, NAMES[i]
        # the gradient of adapter i's block comes from its rows alone: the same loss on those rows only
        (want.square().sum() / logits.numel()).backward()
        r = lcfg.rank
        for name, p in one.named_parameters():
            if p.requires_grad:
                full = dict(model.named_parameters())[name].grad
                block = full[i * r:(i + 1) * r] if name.endswith("lora_A") else full[:, i * r:(i + 1) * r]
                torch.testing.assert_close(block, p.grad, rtol=1e-5, atol=1e-8)
    with torch.no_grad():  # not a trivially equal comparison: another adapter gives other logits
        rows_of(model).use(torch.full(IDS.shape, 1))
        assert rel_err(model(IDS).logits[ROWS == 0], logits[ROWS == 0].detach()) > 1e-3  # adapters differ


def test_a_forward_without_adapter_ids_is_refused():
    model, _ = _several()
    with pytest.raises(RuntimeError, match="without each row's adapter"):
        model(IDS)


def _published(tmp_path):
    """(transformers base, its dir, our model with 3 random adapters, {name: Adapter} as published)."""
    import transformers

    kw = MODELS.get("llama").to_hf_config(DENSE)
    hf, d = hf_reference(getattr(transformers, kw["architectures"][0].replace("ForCausalLM", "Config"))(**kw), tmp_path)
    model = load_into(MODELS.get("llama").build(DENSE), d)
    lcfg = LoraConfig(rank=4, alpha=8.0, adapters=list(NAMES))
    apply_lora(model, lcfg, family="llama")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        state = dict(model.named_parameters())
        for name, t in init_tensors(model, seed=0):
            state[name].copy_(t if "lora_A" in name.split(".") else 0.1 * torch.randn(t.shape, generator=g))
    adapters = split_adapters(gather_adapter(model, lcfg, to_hf=MODELS.get("llama").to_hf, base_model=str(d)), NAMES)
    return hf, d, model, adapters


def test_published_adapters_load_through_peft_with_our_logits(tmp_path):
    peft = pytest.importorskip("peft", reason="peft is in the dev extra (pip install -e '.[dev]')")
    hf, _, model, adapters = _published(tmp_path)
    seen = []
    for i, name in enumerate(NAMES):
        out = write_adapter(tmp_path / "step" / "adapters" / name, adapters[name])
        pm = peft.PeftModel.from_pretrained(hf, out).eval()
        with torch.no_grad():
            rows_of(model).use(torch.full(IDS.shape, i))
            got, want = model(IDS).logits, pm(input_ids=IDS).logits
        assert rel_err(got, want) < 1e-5, name
        seen.append(want)
        hf = pm.unload()  # the plain base again for the next adapter
    assert rel_err(seen[0], seen[1]) > 1e-3  # three different adapters, not one published three times


def test_export_merge_writes_one_model_per_adapter(tmp_path):
    """``slurmrl export --merge RUN OUT --adapter NAME`` (and ``step_N/adapters/NAME``): each merged dir's
    logits in plain transformers equal the base with that adapter (peft), found from the run's step 0."""
    peft = pytest.importorskip("peft", reason="peft is in the dev extra (pip install -e '.[dev]')")
    from transformers import AutoModelForCausalLM

    from tests.helpers.configs import REPO
    from workers.common.protocol import STABLE
    from workers.weights.lora_merge import merge

    hf, d, _, adapters = _published(tmp_path)
    run = tmp_path / "run"
    shutil.copytree(d, run / "weights" / "step_000000")
    step = run / "weights" / "step_000002"
    for name in NAMES:
        adapters[name].base_model = None  # the base is the run's step 0
        write_adapter(step / "adapters" / name, adapters[name], step=2)
    (step / STABLE).write_text("")
    with pytest.raises(ValueError, match=r"several LoRA adapters \['even', 'odd', 'third'\]: name one with --adapter"):
        merge(run, tmp_path / "none")
    with pytest.raises(ValueError, match="--adapter 'fourth' is not in"):
        merge(run, tmp_path / "none", adapter_name="fourth")
    done = subprocess.run([sys.executable, "-m", "launcher", "export", "--merge", str(run), str(tmp_path / "even"),
                           "--adapter", "even"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    merge(step / "adapters" / "odd", tmp_path / "odd")
    merge(step, tmp_path / "third", adapter_name="third")
    seen = []
    for name in NAMES:
        pm = peft.PeftModel.from_pretrained(hf, step / "adapters" / name).eval()
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()
        with torch.no_grad():
            want, got = pm(input_ids=IDS).logits, merged(input_ids=IDS).logits
        assert rel_err(got, want) < 1e-5, name
        seen.append(got)
        hf = pm.unload()
    assert rel_err(seen[0], seen[1]) > 1e-3 and rel_err(seen[1], seen[2]) > 1e-3
