"""A user's own env class, living outside the repository (a temp dir on PYTHONPATH) and named only by
a YAML in the user's own config dir (``_target_``, hydra.searchpath), trains the tiny model through
the CLI: every role imports it, steps are 1-based, and the sample completions of each step land in
the orchestrator log, metrics.jsonl and TensorBoard."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO
from tests.integration.conftest import SMALL, assert_no_children_left, metrics
from tests.unit.test_env_target import USER_ENVS


def test_user_env_class_from_own_config_dir_trains_with_sample_logs(tmp_path):
    user = tmp_path / "user"
    (user / "conf" / "env").mkdir(parents=True)
    (user / "h21_envs.py").write_text(USER_ENVS)
    (user / "conf" / "env" / "first_digit.yaml").write_text("_target_: h21_envs:FirstDigit\nargs: {length: 3}\n")
    run_dir = tmp_path / "run"
    args = [*SMALL, f"hydra.searchpath=[file://{user / 'conf'}]", "env=first_digit", "trainer.num_steps=3",
            "orchestrator.log_samples_every_steps=1", "orchestrator.num_logged_samples=3", f"launcher.run_dir={run_dir}"]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{user}", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "launcher", f"cluster.runs_root={tmp_path / 'runs'}", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "step   1/3 | reward" in proc.stdout and "step   3/3 | reward" in proc.stdout
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3] and [r["policy_version"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert [s["rank"] for s in r["samples"]] == ["best", "rank 8", "worst"], r["samples"]  # 16 samples a step
        assert r["samples"][0]["reward"] >= r["samples"][-1]["reward"] and r["samples"][0]["prompt"].startswith("1 ")
    orch_log = (run_dir / "logs" / "orchestrator_0.log").read_text()
    assert all(f"step {n} sample (worst): reward" in orch_log for n in (1, 2, 3))
    assert (run_dir / "config" / "run.yaml").read_text().count("_target_: h21_envs:FirstDigit") == 1
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert_no_children_left(run_dir)
