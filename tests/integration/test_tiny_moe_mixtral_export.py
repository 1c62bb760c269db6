"""Issue 47 item 12: a bring-your-own dataset run on the default model (tiny_moe) says in its plan
that its published steps are not Hugging Face directories, and ``python -m
workers.weights.filesystem.resolve STEP OUT`` turns its last step (a sparse patch on an anchor)
into a ``MixtralForCausalLM`` directory with the byte tokenizer: transformers loads it with no
missing or unexpected keys, computes the trainer's logits, and its tokenizer prompts it as the run did."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
import transformers

from tests.conftest import REPO
from tests.integration.conftest import SMALL, metrics
from workers.common.config.run import load_run_config
from workers.models.tiny_moe.model import TinyMoeForCausalLM
from workers.weights.filesystem.receiver import DiskReader
from workers.weights.filesystem.resolve import main as resolve_main

BYOT = REPO / "docs" / "examples" / "byot"
TINY = ["model.vocab_size=264", "model.max_position_embeddings=64", "model.hidden_size=32", "model.num_layers=2",
        "model.expert_intermediate_size=32", "model.num_experts=4"]


VARIED = "def varied(prompt, completion, sample):\n    return float(len(completion) % 2)\n"
"""A reward that differs within a group from the first step (a random model earns none of the docs'
rewards): the advantages are not zero, so the step resolved is a trained one."""


def test_a_default_model_step_resolves_into_a_mixtral_directory(tmp_path):
    run_dir = tmp_path / "run"
    (tmp_path / "varied_reward.py").write_text(VARIED)
    args = [*SMALL, *TINY, "env=dataset", f"env.path={BYOT / 'train.jsonl'}", "env.prompt_key=question",
            "env.reward_fn=varied_reward:varied", "env.max_new_tokens=4",
            "orchestrator.advantage=sequence", "trainer.num_steps=2", "trainer.lr=1e-2",
            "weights.keep_last=10", "weights.delta=true", f"launcher.run_dir={run_dir}", f"cluster.runs_root={tmp_path / 'runs'}"]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path}", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "launcher", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "published steps are NOT Hugging Face directories" in proc.stdout  # said before it started
    last = run_dir / "weights" / "step_000002"
    assert not (last / "config.json").exists()
    assert json.loads((last / "index.json").read_text())["anchor"] == 0  # a sparse patch on step 0
    out = tmp_path / "mixtral"
    assert resolve_main([str(last), str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    cfg = load_run_config(str(run_dir / "config" / "run.yaml"))
    ours = TinyMoeForCausalLM(cfg.model)
    published = DiskReader().load(last).state
    ours.load_state_dict(published, strict=True)
    step0 = DiskReader().load(run_dir / "weights" / "step_000000").state
    assert any(r["grad_norm"] > 0 for r in metrics(run_dir)), metrics(run_dir)
    assert any(not torch.equal(published[k], step0[k]) for k in step0)  # a trained step, not the init
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template([{"role": "user", "content": "3+4="}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    assert ids[0, 0].item() == 1 and ids[0, -1].item() == 4  # BOS ... ASSISTANT: the run's byte chat template
    with torch.no_grad():
        a, b = hf.eval()(input_ids=ids).logits, ours.eval()(ids).logits
    assert (a - b).abs().max() <= 1e-5 * b.abs().max(), (a - b).abs().max()
    assert resolve_main([str(last), str(out)]) == 2  # an existing output directory is refused, not overwritten
