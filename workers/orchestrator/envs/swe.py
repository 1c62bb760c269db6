"""swe: a software-engineering task in the shape of SWE-bench, generated: a repository snapshot,
an issue report, tools, and a reward from tests the agent never sees.

Episode: the first prompt is the issue ("``add(3, 4)`` returns 8, but it should return 7") and
the file list of a small Python repository (a module with one injected bug per function, a README
and the repository's own test file holding up to ``env.num_visible_tests`` tests that the buggy
code still passes, like an existing suite that missed the bug). The agent
works with the tools of env=code_repair (read_file, write_file, patch, run_tests, submit; format
in envs/tools.py); ``run_tests`` runs only the repository's visible tests. On ``submit`` (or
when a limit ends the episode) the hidden tests — all of the task's tests, including the one the
issue describes — are copied in and run in the sandbox; reward = the fraction passing.

Why hidden tests: an agent that only makes the visible tests pass (or edits around them) must
not earn the reward; the issue text is the specification, as in SWE-bench, and reproducing it
(editing, running, reading failures) is the skill. Tasks come from envs/code_tasks.py (seeded,
unlimited, with a known fix, so tests can check that a perfect agent earns 1).

The large presets (experiment=glm5_swe_28xh200, kimi_k2_swe_32xh200, nemotron3_ultra_pd_20xh200)
use it with long-context limits (tens of turns, episodes of 64K tokens); experiment=tiny_swe runs
it on CPU. The byte chat template (envs/chat.py) is the tokenizer: ``model.vocab_size`` >= 264.
"""
from __future__ import annotations

import ast
import dataclasses
import secrets
from typing import Any

from workers.common.config.ranges import ge, limits
from workers.common.registry import ENVS
from workers.orchestrator.envs.chat import VOCAB_SIZE
from workers.orchestrator.envs.code_repair import (TOOLS, CodeRepairConfig, CodeRepairEnv, CodeRepairSession,
                                                   check as check_code_repair, host_check)
from workers.orchestrator.envs.code_tasks import Task, make_task
from workers.orchestrator.envs.spec import EnvSpec
from workers.orchestrator.envs.tools import usage


@dataclasses.dataclass(kw_only=True)
class SweConfig(CodeRepairConfig):
    name: str = "swe"
    """Task name."""
    num_visible_tests: int = 1
    """Tests kept in the repository's test file (what run_tests runs); the reward runs all of them, hidden."""


limits(SweConfig, num_visible_tests=ge(0))


def check(run_cfg: Any) -> None:
    """code_repair's checks (episode limits, sandbox), and the visible tests fit the task's tests."""
    check_code_repair(run_cfg)
    e = run_cfg.env
    total = e.num_functions * e.num_tests_per_function
    if e.num_visible_tests > total:
        raise ValueError(f"env.num_visible_tests({e.num_visible_tests}) > the task's tests ({total} = env.num_functions"
                         f"({e.num_functions}) x env.num_tests_per_function({e.num_tests_per_function}))")


@dataclasses.dataclass(frozen=True)
class SweTask(Task):
    issue: str = ""
    """The issue report: one hidden test's call, what the buggy code returns, what it should."""
    hidden_tests: str = ""
    """Source of every test (the reward); never in the repository during the episode."""
    hidden_names: tuple[str, ...] = ()


def _test_functions(source: str) -> tuple[str, list[tuple[str, str, ast.Assert]]]:
    """(import header, [(name, source, its assert)]) of a generated test file (code_tasks.make_task)."""
    tree = ast.parse(source)
    header = "\n".join(ast.get_source_segment(source, n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)))
    funcs = [(n.name, ast.get_source_segment(source, n), n.body[0]) for n in tree.body if isinstance(n, ast.FunctionDef)]
    return header, funcs


def make_swe_task(task_id: int, rng, *, num_functions: int, num_tests: int, num_visible: int) -> SweTask:
    """A code_tasks project turned into a repository + issue + hidden tests (module docstring)."""
    base = make_task(task_id, rng, num_functions=num_functions, num_tests=num_tests)
    module_src = base.files[base.module_file]
    header, funcs = _test_functions(base.files[base.test_file])
    scope: dict[str, Any] = {}
    exec(module_src, scope)  # noqa: S102 - generated template code (code_tasks.py), not model output
    issue, passing = "", []
    for name, src, node in funcs:
        call, expected = ast.unparse(node.test.left), node.test.comparators[0]
        try:
            value = eval(call, scope)  # noqa: S307 - same trusted code
            if value == ast.literal_eval(expected):
                passing.append(src)  # the bug does not show here: a test the repository may already have
                continue
            got = f"returns {value!r}"
        except Exception as e:  # noqa: BLE001 - the bug may raise
            got = f"raises {type(e).__name__}"
        issue = issue or f"Issue #{task_id}: `{call}` in {base.module_file} {got}, but it should return {ast.unparse(expected)}."
    visible_src = header + "\n\n\n" + "\n\n\n".join(passing[:num_visible]) + "\n"
    names = tuple(n for n, _, _ in funcs)
    defined = [n.name for n in ast.parse(module_src).body if isinstance(n, ast.FunctionDef)]
    readme = f"# {base.module}\n\nFunctions: {', '.join(defined)}. Tests: {base.test_file}.\n"
    files = {base.module_file: module_src, base.test_file: visible_src, "README.md": readme}
    return SweTask(task_id=task_id, module=base.module, files=files, solution=base.solution, test_file=base.test_file,
                   test_names=tuple(n for n, src, _ in funcs if src in passing[:num_visible]), issue=issue, hidden_tests=base.files[base.test_file],
                   hidden_names=names)


class SweEnv(CodeRepairEnv):
    name = "swe"

    def sample_task(self) -> SweTask:
        self.next_id += 1
        return make_swe_task(self.next_id, self.rng, num_functions=self.cfg.num_functions,
                             num_tests=self.cfg.num_tests_per_function, num_visible=self.cfg.num_visible_tests)

    def first_message(self, task: SweTask) -> str:
        text = f"{task.issue}\nFix the repository so the issue is resolved.\nfiles: {' '.join(sorted(task.files))}\n"
        if self.cfg.include_tool_help:
            text += "One tool call per turn: " + usage(TOOLS) + "\n"
        return text

    def session(self, task: SweTask, episode_id: str) -> "SweSession":
        return SweSession(self, task, episode_id)


class SweSession(CodeRepairSession):
    """A code_repair session whose final score comes from the hidden tests."""

    async def final_reward(self) -> float:
        passed, _ = await self.hidden_score()
        return passed / len(self.task.hidden_names)

    async def hidden_score(self) -> tuple[int, bool]:
        """(hidden tests passed, timed out): the hidden test file is written under a fresh name the
        agent could not have prepared (test files are read-only to it), run, and removed."""
        key = "hidden:" + self._content_hash()
        if key in self.env.scores:
            return self.env.scores[key][:2]
        name = f"test_hidden_{secrets.token_hex(4)}.py"
        self._write(name, self.task.hidden_tests)
        try:
            results, timed_out = await self.run_test_file(name)
        finally:
            (self.dir / name).unlink(missing_ok=True)
        passed = sum(1 for n in self.task.hidden_names if results.get(n, ("",))[0] == "PASS")
        self.env.scores[key] = (passed, timed_out, "")
        return passed, timed_out


ENVS.register(EnvSpec(name="swe", config=SweConfig, vocab_size=lambda cfg: VOCAB_SIZE, env_check=check,
                      host_check=host_check, eval_split=True, make=lambda cfg, *, seed, model=None: SweEnv(cfg, seed=seed),
                      summary="resolve an issue in a small repository with tools; reward from hidden tests (sandbox)"))
