"""code_repair: generated tasks, tools, rewards, and escape attempts through the tools (real sandbox)."""
from __future__ import annotations

import asyncio
import random

import pytest

from workers.orchestrator.envs import make_env
from workers.orchestrator.envs.chat import EOT, ByteTokenizer
from workers.orchestrator.envs.code_repair import CodeRepairConfig
from workers.orchestrator.envs.code_tasks import make_task

TOK = ByteTokenizer()


def env(tmp_path, **kw):
    return make_env(CodeRepairConfig(sandbox_scratch_root=str(tmp_path / "scratch"), sandbox_cpu_s=1,
                              sandbox_timeout_s=3.0, max_observation_bytes=2048, **kw), seed=0)


def turn(text):
    return TOK.encode(text) + [EOT]


def play(e, task, texts):
    """Run scripted turns; returns (observations, final StepResult, session)."""
    async def go():
        s = e.session(task, "ep")
        await s.reset()
        obs, res = [], None
        for t in texts:
            res = await s.step(turn(t))
            obs.append(TOK.decode(res.observation_ids))
            if res.done:
                break
        final = res.reward if res.done else await s.final_reward()
        metrics = dict(s.metrics)
        await s.close()
        return obs, final, metrics, s.dir
    return asyncio.run(go())


def test_tasks_are_deterministic_and_have_a_failing_test():
    a = [make_task(i, random.Random(3), num_functions=2, num_tests=3) for i in range(3)]
    b = [make_task(i, random.Random(3), num_functions=2, num_tests=3) for i in range(3)]
    assert a == b
    for seed in range(30):
        t = make_task(0, random.Random(seed), num_functions=1, num_tests=3)
        assert len(t.test_names) == 3 and t.files[t.module_file] != t.solution[t.module_file]


def test_perfect_agent_earns_one_and_idle_agent_earns_the_baseline(tmp_path):
    e = env(tmp_path, num_functions=2)
    task = e.sample_task()
    src = task.solution[task.module_file]
    obs, reward, m, scratch = play(e, task, [
        f'<tool name="read_file" path="{task.module_file}"/>',
        f'<tool name="write_file" path="{task.module_file}">\n{src}</tool>',
        '<tool name="run_tests"/>',
        '<tool name="submit"/>',
    ])
    assert obs[0] == task.files[task.module_file][:2048]
    assert obs[2].startswith(f"passed {len(task.test_names)}/{len(task.test_names)}")
    assert reward == 1.0 and m["sandbox_runs"] == 1  # submit reused the cached score
    assert m["sandbox_mode"] in ("namespaces", "userns", "rlimits")
    assert not scratch.exists(), "the episode's scratch dir outlived the episode"
    _, idle, _, _ = play(e, task, ['<tool name="submit"/>'])
    assert 0 <= idle < 1


def test_patch_fixes_the_bug(tmp_path):
    e = env(tmp_path)
    task = e.sample_task()
    old, new = task.files[task.module_file].rstrip("\n"), task.solution[task.module_file].rstrip("\n")
    patch = f"<<<<<<< SEARCH\n{old}\n=======\n{new}\n>>>>>>> REPLACE"
    obs, reward, _, _ = play(e, task, [f'<tool name="patch" path="{task.module_file}">\n{patch}\n</tool>'])
    assert obs[0] == f"patched {task.module_file}" and reward == 1.0


def test_bad_turns_cost_a_turn_not_the_episode(tmp_path):
    e = env(tmp_path)
    task = e.sample_task()
    obs, reward, m, _ = play(e, task, ["just text", "<tool name=oops", '<tool name="read_file" path="nope.py"/>',
                                       f'<tool name="patch" path="{task.module_file}">garbage</tool>'])
    assert [o.startswith("error:") for o in obs] == [True] * 4, obs
    assert m["tool_errors"] == 4 and 0 <= reward < 1


@pytest.mark.parametrize("path", ["/etc/passwd", "../../etc/passwd", "a/../../x.py", "..", "", "~/x", "a//b",
                                  "x" * 200])
def test_file_tools_refuse_paths_outside_the_project(tmp_path, path):
    e = env(tmp_path)
    task = e.sample_task()
    obs, _, _, _ = play(e, task, [f'<tool name="read_file" path="{path}"/>',
                                  f'<tool name="write_file" path="{path}">x</tool>'])
    assert all(o.startswith("error: bad path") for o in obs), obs
    assert not (tmp_path / "x.py").exists()


def test_symlinks_and_test_files_are_refused(tmp_path):
    e = env(tmp_path)
    task = e.sample_task()

    async def go():
        s = e.session(task, "ep")
        await s.reset()
        (s.dir / "link.py").symlink_to("/etc/passwd")
        out = [TOK.decode((await s.step(turn(t))).observation_ids) for t in (
            '<tool name="read_file" path="link.py"/>', '<tool name="write_file" path="link.py">x</tool>',
            f'<tool name="write_file" path="{task.test_file}">def test_x(): pass</tool>')]
        await s.close()
        return out
    obs = asyncio.run(go())
    assert "symlink" in obs[0] and "symlink" in obs[1] and "read-only" in obs[2], obs


def test_hanging_and_broken_code_score_zero(tmp_path):
    e = env(tmp_path)
    task = e.sample_task()
    obs, reward, m, _ = play(e, task, [f'<tool name="write_file" path="{task.module_file}">\nwhile True:\n    pass\n</tool>',
                                       '<tool name="run_tests"/>'])
    assert reward == 0.0 and m["sandbox_timeouts"] == 1 and "killed" in obs[1], obs
    obs, reward, _, _ = play(e, task, [f'<tool name="write_file" path="{task.module_file}">def (:</tool>',
                                       '<tool name="run_tests"/>'])
    assert reward == 0.0 and "SyntaxError" in obs[1], obs


def test_printed_fake_passes_do_not_count(tmp_path):
    e = env(tmp_path)
    task = e.sample_task()
    fake = "".join(f"print('x PASS {task.test_file}::{n}')\n" for n in task.test_names)
    obs, reward, _, _ = play(e, task, [f'<tool name="write_file" path="{task.module_file}">\n{fake}</tool>',
                                       '<tool name="submit"/>'])
    assert reward == 0.0


def test_verifiers_env_is_visibly_unimplemented():
    from workers.orchestrator.envs.verifiers_adapter import VerifiersConfig
    with pytest.raises(NotImplementedError, match="verifiers 0.4.0"):
        make_env(VerifiersConfig(verifiers_env="x"), seed=0)


def test_plan_refuses_verifiers_saying_what_is_missing():
    from launcher.plan import PlanError, build_plan
    from tests.conftest import compose
    for overrides in (["env=verifiers"], ["experiment=tiny_code_repair", "env=verifiers", "env.verifiers_env=x"]):
        with pytest.raises(PlanError, match="env=verifiers is not implemented: .*missing here: a verifiers Client"):
            build_plan(compose(overrides))


def test_plan_vocab_is_the_chat_templates():
    from workers.common.registry import ENVS
    from workers.orchestrator.envs.chat import VOCAB_SIZE
    assert ENVS.get("code_repair").vocab_size(CodeRepairConfig()) == VOCAB_SIZE


def test_plan_refuses_bad_multi_turn_settings():
    from launcher.plan import PlanError, build_plan
    from tests.conftest import compose
    base = ["experiment=tiny_code_repair"]
    assert build_plan(compose(base)).roles
    for bad, fragment in [("orchestrator.long_episode_policy=maybe", "long_episode_policy"),
                          ("env.max_episode_tokens=100000", "max_position_embeddings"),
                          ("env.sandbox_mode=docker", "sandbox_mode"), ("model.vocab_size=16", r"vocabulary \(264\)")]:
        with pytest.raises(PlanError, match=fragment):
            build_plan(compose([*base, bad]))
    with pytest.raises(PlanError, match="long_episode_policy"):
        build_plan(compose(["orchestrator.long_episode_policy=maybe"]))  # reverse_digits too


def test_plan_refuses_the_weak_sandbox_unless_allowed():
    from launcher.plan import PlanError, build_plan
    from tests.conftest import compose
    base = ["experiment=tiny_code_repair", "env.sandbox_mode=rlimits"]
    with pytest.raises(PlanError, match=r"env\.sandbox_allow_weak=true"):
        build_plan(compose(base))
    assert build_plan(compose([*base, "env.sandbox_allow_weak=true"])).roles


def test_weak_mode_env_scores_tests(tmp_path):
    """The weak mode (Landlock, reaper, closed fds) still runs the runner and its tests."""
    e = env(tmp_path, sandbox_mode="rlimits", sandbox_allow_weak=True)
    task = e.sample_task()
    src = task.solution[task.module_file]
    obs, reward, m, _ = play(e, task, [f'<tool name="write_file" path="{task.module_file}">\n{src}</tool>',
                                       '<tool name="submit"/>'])
    assert reward == 1.0 and m["sandbox_mode"] == "rlimits", (obs, m)


def test_host_check_runs_before_anything_is_written(tmp_path):
    """A local run asks the env's host_check on this machine before the run dir exists: code_repair's
    probes the sandbox (auto finds namespaces here, as root), and a refusal stops the launch with the key."""
    import dataclasses

    from launcher.launch import check_host, prepare
    from launcher.plan import PlanError
    from tests.conftest import compose
    from workers.common.registry import ENVS

    check_host(compose(["experiment=tiny_code_repair"]))  # namespaces work here: no refusal
    spec = ENVS.get("code_repair")

    def refuse(run_cfg):
        raise ValueError("env.sandbox_mode=auto: no isolating mode on this host (test)")

    ENVS.register(dataclasses.replace(spec, host_check=refuse), replace=True)
    try:
        cfg = compose(["experiment=tiny_code_repair", f"launcher.run_dir={tmp_path / 'run'}"])
        with pytest.raises(PlanError, match="env.sandbox_mode=auto"):
            prepare(cfg)
        assert not (tmp_path / "run").exists()
    finally:
        ENVS.register(spec, replace=True)
