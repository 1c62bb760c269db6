"""The own-environment example (docs/examples/own_env: a module and a YAML in a config dir
of the user's, outside the project's packages) trains the tiny model through the CLI: the env class
is named only by ``_target_`` in that YAML (hydra.searchpath), every role imports it from
PYTHONPATH, steps are 1-based, and each step's sample completions land in the orchestrator log,
metrics.jsonl and TensorBoard."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO
from tests.integration.conftest import SMALL, assert_no_children_left, metrics

EXAMPLE = REPO / "docs" / "examples" / "own_env"


def test_user_env_class_from_own_config_dir_trains_with_sample_logs(tmp_path):
    run_dir = tmp_path / "run"
    args = [*SMALL, f"hydra.searchpath=[file://{EXAMPLE / 'conf'}]", "env=first_digit", "trainer.num_steps=3",
            "orchestrator.log_samples_every_steps=1", "orchestrator.num_logged_samples=3", f"launcher.run_dir={run_dir}"]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{EXAMPLE}", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "launcher", f"cluster.runs_root={tmp_path / 'runs'}", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "step   1/3 | reward" in proc.stdout and "step   3/3 | reward" in proc.stdout
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3] and [r["policy_version"] for r in recs] == [1, 2, 3]
    for r in recs:  # 16 samples a step: ranks 1, 9 and 16 of the rewards
        assert [s["rank"] for s in r["samples"]] == ["best", "rank 9", "worst"], r["samples"]
        assert r["samples"][0]["reward"] >= r["samples"][-1]["reward"] and r["samples"][0]["prompt"].startswith("1 ")
    orch_log = (run_dir / "logs" / "orchestrator_0.log").read_text()
    assert all(f"step {n} sample (worst): reward" in orch_log for n in (1, 2, 3))
    assert "_target_: my_envs:FirstDigit" in (run_dir / "config" / "run.yaml").read_text()
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert_no_children_left(run_dir)
