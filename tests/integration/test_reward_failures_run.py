"""A reward module that raises on every call: the run stops after orchestrator.max_failed_reward_steps
steps with the exception on the console and a non-zero exit (not "finished" with reward 0.000)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.integration.conftest import SMALL

TINY = ["model.vocab_size=264", "model.max_position_embeddings=64", "model.hidden_size=64", "model.num_layers=2",
        "model.expert_intermediate_size=64"]


@pytest.mark.slow
def test_a_reward_that_always_raises_stops_the_run_naming_the_exception(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "broken_rewards.py").write_text("def score(prompt, completion, sample):\n"
                                            "    return sample['missing_field'] == completion\n")
    data = user / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+1", "answer": str(a + 1)}) + "\n" for a in range(20)))
    args = [*SMALL, *TINY, "env=dataset", f"env.path={data}", "env.prompt_key=question",
            "env.reward_fn=broken_rewards:score", "env.max_new_tokens=4", "trainer.num_steps=8",
            "orchestrator.max_failed_reward_steps=2", f"launcher.run_dir={tmp_path / 'run'}"]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{user}", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "launcher", f"cluster.runs_root={tmp_path / 'runs'}", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "exited with code 78" in out and "not restarted" in out, out[-3000:]
    assert "stopping the run. slurmrl: error: every reward call failed" in out, out[-3000:]
    assert "restart 1/" not in out
    assert "every reward call failed for 2 consecutive steps" in out and "KeyError: 'missing_field'" in out, out[-3000:]
