"""All four plugin axes at once, from the test tree, in one real local run (issue: one home per axis).

``SLURMRL_PLUGINS`` names four test-only modules (tests/plugins/), and the config picks their entries:
a model family (``tiny_moe_scaled``: its own schema field ``init_scale``, its own init), a weight
transport (``fake_copy``: its own publisher, coordinator and receiver), an env (``count_up``: its own
config, check, vocabulary and scoring) and an inference backend (``fake_embedded_cli``: its own launch
command and option ``greeting``). No project file names any of them. The real ``slurmrl`` CLI starts
a trainer, two workers and the orchestrator; each entry must leave its own trace, and the run learns.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
PLUGINS = ",".join(f"tests.plugins.{axis}_plugin" for axis in ("models", "weights", "envs", "backends"))
CHOICES = ["model=tiny_moe_scaled", "weights=fake_copy", "env=count_up", "inference=fake_embedded_cli",
           "inference.greeting=hello-from-the-test-tree"]
SETTINGS = ["orchestrator.max_off_policy_steps=1", "trainer.lr=1e-3"]  # 16 prompts x 4 samples a step
NUM_STEPS = 40  # ~15 s on 2 cores: reward ~0.07 -> ~0.2


def slurmrl(args: list[str], tmp_path: Path, *, plugins: str = PLUGINS) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "launcher", f"cluster.runs_root={tmp_path / 'runs'}", *args]
    env = dict(os.environ, SLURMRL_PLUGINS=plugins)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=420)


def test_every_axis_from_the_test_tree_in_one_run(tmp_path):
    run_dir = tmp_path / "all"
    proc = slurmrl([*CHOICES, *SETTINGS, f"trainer.num_steps={NUM_STEPS}", f"launcher.run_dir={run_dir}"], tmp_path)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert f"finished: {NUM_STEPS} steps" in proc.stdout
    run_yaml = (run_dir / "config" / "run.yaml").read_text()
    for axis in ("models", "weights", "envs", "backends"):  # the roles import the same plugins from run.yaml
        assert f"tests.plugins.{axis}_plugin" in run_yaml
    # model: the family's own init (init_scale) made step 0
    step0 = load_file(str(next((run_dir / "weights" / "step_000000").glob("*.safetensors"))))
    assert "model.embed_tokens.weight" in step0 and torch.isfinite(step0["model.embed_tokens.weight"]).all()
    # weights: only step 0 on the filesystem; every update went through the plugin's copies, verified
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["step_000000"]
    applied = [json.loads(p.read_text()) for p in sorted((run_dir / "weights_copy").glob("v_*/APPLIED.json"))]
    assert applied and all(a["ok"] and len(a["digests"]) == 2 for a in applied), applied  # the copies kept
    # backend: each worker was started through the plugin's own command and said its greeting
    logs = [(run_dir / "logs" / f"inference_{i}.log").read_text() for i in range(2)]
    assert all("-m tests.plugins.backends_plugin --greeting hello-from-the-test-tree" in log for log in logs)
    assert all("fake_embedded_cli says 'hello-from-the-test-tree'" in log for log in logs)
    # env: count_up scored every sample, and the policy learned its task
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert len(metrics) == NUM_STEPS
    assert metrics[-1]["weight_updates_verified"] >= NUM_STEPS // 2 and metrics[-1]["weight_updates_mismatched"] == 0
    first = sum(m["reward_mean"] for m in metrics[:5]) / 5
    last = sum(m["reward_mean"] for m in metrics[-5:]) / 5
    assert last > first + 0.05, [round(m["reward_mean"], 3) for m in metrics]


def test_without_the_plugins_the_same_choices_are_refused_by_name(tmp_path):
    proc = slurmrl([*CHOICES, "launcher.dry_run=true"], tmp_path, plugins="")
    assert proc.returncode == 2, proc.stderr[-2000:]
    # every missing choice is named, with the group's options (the launcher's message, not Hydra's first miss)
    assert "4 unknown keys" in proc.stderr, proc.stderr[-2000:]
    for name in ("tiny_moe_scaled", "fake_copy", "count_up", "fake_embedded_cli"):
        assert f"={name} is not an option of" in proc.stderr, (name, proc.stderr[-2000:])
