"""Rewards by import path (workers/orchestrator/rewards): loading and its refusals, running with
a timeout (sync and async), exceptions and non-numbers as counted failures, dicts of named rewards,
math answer equivalence, and code tests in the sandbox."""
from __future__ import annotations

import asyncio
import sys
import time

import pytest

from workers.orchestrator.rewards import RewardRunner, load_reward
from workers.orchestrator.rewards.answers import equivalent, exact_match, extract_answer, math_equal
from workers.orchestrator.rewards import code_tests

USER_MODULE = '''
import asyncio, time

def score(prompt, completion, sample):
    return float(completion == sample["answer"])

async def ascore(prompt, completion, sample):
    await asyncio.sleep(0)
    return 0.5

def boom(prompt, completion, sample):
    raise RuntimeError("bad row")

def hang(prompt, completion, sample):
    time.sleep(30)
    return 1.0

async def ahang(prompt, completion, sample):
    await asyncio.sleep(30)

def nan(prompt, completion, sample):
    return float("nan")

def text(prompt, completion, sample):
    return "1.0"

def exits(prompt, completion, sample):
    raise SystemExit(3)

def two_args(prompt, completion):
    return 1.0

NAMED = {"correct": score, "format": lambda p, c, s: 0.25 if c.isdigit() else 0.0}
'''


@pytest.fixture
def mod(tmp_path, monkeypatch):
    (tmp_path / "user_rewards.py").write_text(USER_MODULE)
    (tmp_path / "broken_rewards.py").write_text("import not_a_module_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_rewards"
    for name in ("user_rewards", "broken_rewards"):
        sys.modules.pop(name, None)


def run(spec: str, completion: str = "7", *, timeout_s: float = 2.0, answer: str = "7"):
    runner = RewardRunner(load_reward(spec), timeout_s=timeout_s)
    return asyncio.run(runner.score("2+5", completion, {"answer": answer}))


def test_plain_async_and_builtin_rewards(mod):
    assert run("user_rewards:score").total == 1.0 and run("user_rewards:score", "8").total == 0.0
    assert run("user_rewards:ascore").total == 0.5
    assert run("exact_match", " 7 ").total == 1.0
    assert run("math_equal", "so the answer is \\boxed{7}").total == 1.0
    assert load_reward("workers.orchestrator.rewards.answers:math_equal").functions[""] is math_equal


def test_a_dict_of_rewards_is_summed_and_each_reported(mod):
    s = run("user_rewards:NAMED")
    assert s.total == 1.25 and s.parts == {"correct": 1.0, "format": 0.25} and s.failures == []


@pytest.mark.parametrize("name, why", [
    ("boom", "raised RuntimeError: bad row"),
    ("nan", "returned nan, not a finite number"),
    ("text", "returned str '1.0', not a number"),
    ("exits", "raised RuntimeError: SystemExit: 3"),
])
def test_failures_score_zero_and_are_named(mod, name, why):
    s = run(f"user_rewards:{name}")
    assert s.total == 0.0 and s.failures == [f"user_rewards:{name}: {why}"]


@pytest.mark.parametrize("name", ["hang", "ahang"])
def test_a_hung_reward_times_out_without_blocking(mod, name):
    t0 = time.monotonic()
    s = run(f"user_rewards:{name}", timeout_s=0.3)
    assert time.monotonic() - t0 < 5
    assert s.total == 0.0 and s.failures == [f"user_rewards:{name}: timed out after 0.3s (env.reward_timeout_s)"]


def test_one_failing_named_reward_keeps_the_others(mod, monkeypatch):
    import user_rewards

    monkeypatch.setitem(user_rewards.NAMED, "format", user_rewards.boom)
    s = run("user_rewards:NAMED")
    assert s.total == 1.0 and s.parts == {"correct": 1.0, "format": 0.0} and s.failures[0].startswith("format: raised")


@pytest.mark.parametrize("spec, match", [
    ("user_rewards", "write 'module.path:function'"),
    ("nowhere_at_all:score", "cannot import module 'nowhere_at_all' .*PYTHONPATH"),
    ("broken_rewards:score", "cannot import module 'broken_rewards' \\(ModuleNotFoundError: No module named 'not_a_module"),
    ("user_rewards:nope", "module 'user_rewards' .* has no attribute 'nope'"),
    ("user_rewards:two_args", "cannot be called as f\\(prompt, completion, sample\\)"),
])
def test_load_errors_name_the_path(mod, spec, match):
    with pytest.raises(ValueError, match=match):
        load_reward(spec)


@pytest.mark.parametrize("completion, answer, same", [
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("The answer is 1,000.", "1000", True),
    ("so x = 3/4", "0.75", True),
    ("$\\dfrac{3}{4}$", "3/4", True),
    ("Answer: -2", "-2.0", True),
    ("#### 18", "18", True),
    ("we get 12 then 13", "13", True),
    ("\\boxed{\\text{(B)}}", "(b)", True),
    ("\\boxed{45^\\circ}", "45", True),
    ("\\boxed{\\left(1, 2\\right)}", "(1,2)", True),
    ("\\boxed{0.333333}", "1/3", False),
    ("$x^2$ gives $y = 4$", "4", True),
    ("\\boxed{2}", "3", False),
    ("no number here", "4", False),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", True),
])
def test_math_equivalence(completion, answer, same):
    assert math_equal("", completion, {"answer": answer}) == float(same), extract_answer(completion)


def test_answer_extraction_and_exact_match():
    assert extract_answer("a \\boxed{1} then \\boxed{\\frac{2}{3}}") == "\\frac{2}{3}"
    assert equivalent("1e-3", "0.001") is False  # not a plain decimal: compared as text
    assert exact_match("", "  a   b ", {"answer": "a b"}) == 1.0
    with pytest.raises(KeyError, match="env.answer_key"):
        exact_match("", "x", {})


def test_code_extraction_and_test_sources():
    assert code_tests.extract_code("text\n```python\ndef f():\n    return 1\n```\nmore") == "def f():\n    return 1\n"
    src, names = code_tests.tests_source(["assert f(1) == 2", "assert f(2) == 3"])
    assert names == ["test_0", "test_1"] and src.startswith("from solution import *")
    with pytest.raises(ValueError, match="no test_"):
        code_tests.tests_source("x = 1")


def test_code_tests_run_in_the_sandbox(tmp_path):
    from workers.orchestrator.envs.sandbox import Sandbox, SandboxLimits, SandboxSetupError
    from workers.orchestrator.rewards.code_tests import make_code_tests

    try:
        mode = Sandbox(SandboxLimits(), scratch_root=str(tmp_path)).mode
    except SandboxSetupError:
        mode = "rlimits"
    score = make_code_tests(mode=mode, allow_weak=True, scratch_root=str(tmp_path))
    sample = {"tests": ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(2, 2) == 5"]}
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    assert asyncio.run(score("", good, sample)) == pytest.approx(2 / 3)
    assert asyncio.run(score("", "def add(a, b):\n    while True: pass\n", sample)) == 0.0
