"""swe (workers/orchestrator/envs/swe.py): generated repository + issue + hidden tests, played with
scripted tool calls against the real sandbox; the presets plan with it under long-context limits."""
from __future__ import annotations

import random

import pytest

from launcher.plan import PlanError, build_plan
from tests.conftest import compose
from tests.unit.orchestrator.test_envs_code_repair import play
from workers.orchestrator.envs import make_env
from workers.orchestrator.envs.swe import SweConfig, make_swe_task


def env(tmp_path, **kw):
    return make_env(SweConfig(sandbox_scratch_root=str(tmp_path / "scratch"), sandbox_cpu_s=1, sandbox_timeout_s=3.0,
                              max_observation_bytes=2048, **kw), seed=0)


def test_tasks_hide_the_failing_tests_and_report_one_as_the_issue():
    for seed in range(20):
        t = make_swe_task(seed, random.Random(seed), num_functions=1, num_tests=3, num_visible=2)
        assert t == make_swe_task(seed, random.Random(seed), num_functions=1, num_tests=3, num_visible=2)
        assert t.issue.startswith(f"Issue #{seed}: `") and t.module_file in t.issue and "should return" in t.issue
        call = t.issue.split("`")[1]
        assert call not in t.files[t.test_file] and call in t.hidden_tests  # the reported case is hidden
        assert set(t.test_names) <= set(t.hidden_names) and len(t.hidden_names) == 3 and len(t.test_names) <= 2
        assert "test_hidden" not in " ".join(t.files) and sorted(t.files) == sorted([t.module_file, t.test_file,
                                                                                      "README.md"])


def test_hidden_tests_decide_the_reward(tmp_path):
    e = env(tmp_path, num_visible_tests=2)
    task = e.sample_task()
    src = task.solution[task.module_file]
    obs, reward, m, scratch = play(e, task, ['<tool name="run_tests"/>', '<tool name="submit"/>'])
    visible = len(task.test_names)
    assert obs[0].startswith(f"passed {visible}/{visible}")  # the repository's own tests miss the bug
    assert reward < 1.0  # ... the hidden ones do not
    obs, reward, m, scratch = play(e, task, [f'<tool name="write_file" path="{task.module_file}">\n{src}</tool>',
                                             '<tool name="submit"/>'])
    assert reward == 1.0 and m["sandbox_runs"] == 1 and not scratch.exists()
    assert "Issue #" in e.first_message(task) and "README.md" in e.first_message(task)


def test_hidden_tests_cannot_be_prepared_or_replaced_by_the_agent(tmp_path):
    e = env(tmp_path)
    task = e.sample_task()
    fake = "def test_x():\n    pass\n"
    obs, reward, _, _ = play(e, task, [f'<tool name="write_file" path="test_hidden_0000.py">\n{fake}</tool>',
                                       f'<tool name="write_file" path="{task.test_file}">\n{fake}</tool>',
                                       '<tool name="submit"/>'])
    assert obs[0].startswith("error:") and obs[1].startswith("error:") and reward < 1.0


def test_presets_plan_with_the_swe_env_and_long_context():
    for preset in ("glm5_swe_28xh200", "kimi_k2_swe_32xh200", "nemotron3_ultra_pd_20xh200"):
        cfg = compose([f"experiment={preset}"])
        assert cfg.env.name == "swe" and cfg.env.max_episode_tokens == 131072 and cfg.env.max_turns == 50
        assert build_plan(cfg).roles
    with pytest.raises(PlanError, match=r"env.num_visible_tests\(9\) > the task's tests \(3 ="):
        build_plan(compose(["experiment=tiny_swe", "env.num_visible_tests=9"]))
    with pytest.raises(PlanError, match=r"env.max_episode_tokens\(65536\) > model.max_position_embeddings\(576\)"):
        build_plan(compose(["experiment=tiny_swe", "env.max_episode_tokens=65536"]))
