"""LoRA steps against peft and transformers: a published adapter dir loads with
``PeftModel.from_pretrained``, and ``slurmrl export --merge`` (workers/weights/lora_merge.py) writes a
directory whose logits in plain transformers equal peft's ``merge_and_unload`` (Qwen3-MoE with
attention and expert adapters; the base saved per expert, as on the hub), found from a run directory."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from tests.helpers.configs import REPO
from tests.models.parity import hf_reference, rel_err
from workers.common.protocol import STABLE
from workers.weights.lora_format import read_adapter, write_adapter

peft = pytest.importorskip("peft", reason="peft is in the dev extra (pip install -e '.[dev]')")
IDS = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(base dir, our adapter dir, peft's merged model's logits)."""
    from transformers import Qwen3MoeConfig

    tmp = tmp_path_factory.mktemp("merge")
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                         num_experts_per_tok=2)
    hf, base = hf_reference(cfg, tmp)
    lc = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                         target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    torch.manual_seed(2)
    pm = peft.get_peft_model(hf, lc)
    pm.save_pretrained(tmp / "peft")
    adapter = read_adapter(tmp / "peft")  # peft's own files through our reader, then written by our writer
    adapter.base_model = str(base)
    ours = write_adapter(tmp / "ours", adapter, step=3)
    with torch.no_grad():
        want = pm.merge_and_unload().eval()(input_ids=IDS).logits
    return base, ours, want


def test_published_adapter_loads_with_peft(trained):
    from transformers import AutoModelForCausalLM

    base, ours, want = trained
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), ours).eval()
    with torch.no_grad():
        assert rel_err(model(input_ids=IDS).logits, want) < 1e-5


def test_merge_equals_peft_merge_and_unload_from_a_run_dir(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    base, ours, want = trained
    run = tmp_path / "run"
    shutil.copytree(base, run / "weights" / "step_000000")
    for step in (1, 3):
        shutil.copytree(ours, run / "weights" / f"step_00000{step}")
        (run / "weights" / f"step_00000{step}" / STABLE).write_text("{}")
    (run / "weights" / "step_000001" / "adapter_model.safetensors").write_bytes(b"")  # not the newest: never read
    out = tmp_path / "merged"
    done = subprocess.run([sys.executable, "-m", "launcher", "export", "--merge", str(run), str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(p.name for p in base.glob("*.safetensors"))
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=IDS).logits
        plain = AutoModelForCausalLM.from_pretrained(base).eval()(input_ids=IDS).logits
    assert rel_err(got, want) < 1e-5 and rel_err(plain, want) > 1e-3


def test_merge_refuses_a_base_it_was_not_trained_on(trained, tmp_path):
    from workers.weights.lora_merge import merge

    base, ours, _ = trained
    adapter = read_adapter(ours)
    adapter.tensors = {k.replace("layers.1", "layers.9"): v for k, v in adapter.tensors.items()}
    write_adapter(tmp_path / "bad", adapter)
    with pytest.raises(ValueError, match="adapter targets have no tensor in base"):
        merge(tmp_path / "bad", tmp_path / "out", base=base)
    assert not (tmp_path / "out").exists()
