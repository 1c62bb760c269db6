"""Built-in ``code_tests`` reward: run the completion's code against the sample's tests in the sandbox.

``sample["tests"]`` holds the tests, either Python source with ``test_*`` functions or a list
of assert lines (each becomes one test function). The completion's code is the last fenced
```` ```python ```` block, else the whole completion; it is written to ``solution.py`` and the
tests to ``test_solution.py`` (with ``from solution import *`` first), and the sandbox's own
test runner (envs/sandbox_runner.py, the one env=code_repair uses) runs them under the
sandbox's limits. Reward = fraction of the tests that pass; a test the run never reported (a
crash, a timeout) fails.

``code_tests`` uses the isolating sandbox modes only (``auto``; on a host without namespaces it
raises, which the reward runner counts as a failure and logs). For other limits or the weak
rlimits mode, build your own in your reward module::

    from workers.orchestrator.rewards.code_tests import make_code_tests
    score = make_code_tests(mode="rlimits", allow_weak=True, timeout_s=5.0)
"""
from __future__ import annotations

import ast
import re
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def tests_source(tests) -> tuple[str, list[str]]:
    """(source of test_solution.py, names of its test functions) from source text or assert lines."""
    if isinstance(tests, (list, tuple)):
        body = "".join(f"def test_{i}():\n    {line.strip()}\n\n" for i, line in enumerate(tests))
    elif isinstance(tests, str):
        body = tests
    else:
        raise TypeError(f"sample['tests'] must be source text or a list of assert lines, got {type(tests).__name__}")
    source = "from solution import *  # noqa\n\n" + body
    names = [n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
    if not names:
        raise ValueError("sample['tests'] defines no test_* function")
    return source, names


def make_code_tests(*, mode: str = "auto", allow_weak: bool = False, timeout_s: float = 10.0, cpu_s: int = 2,
                    memory_mb: int = 256, scratch_root: Optional[str] = None) -> Callable:
    """An async reward ``(prompt, completion, sample) -> fraction of tests passed`` over one sandbox
    (created on first use, in the orchestrator: the plan only imports this module)."""
    sandbox = None

    async def code_tests(prompt: str, completion: str, sample: dict) -> float:
        nonlocal sandbox
        from workers.orchestrator.envs.sandbox import Sandbox, SandboxLimits

        if sandbox is None:
            sandbox = Sandbox(SandboxLimits(cpu_s=cpu_s, memory_mb=memory_mb, timeout_s=timeout_s), mode=mode,
                              scratch_root=scratch_root, allow_weak=allow_weak)
        if "tests" not in sample:
            raise KeyError("sample has no 'tests' field (source with test_* functions or a list of asserts)")
        source, names = tests_source(sample["tests"])
        project = Path(tempfile.mkdtemp(prefix="reward-", dir=sandbox.scratch_root))
        try:
            project.chmod(0o755)
            for name, text in (("solution.py", extract_code(completion)), ("test_solution.py", source)):
                (project / name).write_text(text)
                (project / name).chmod(0o644)
            nonce = secrets.token_hex(8)
            res = await sandbox.run_python([sandbox.runner, "test_solution.py"], project=project,
                                           stdin=(nonce + "\n").encode())
        finally:
            shutil.rmtree(project, ignore_errors=True)
        passed = set()
        for line in res.stdout.splitlines():
            parts = line.split(" ", 3)
            if len(parts) >= 3 and parts[0] == nonce and parts[1] == "PASS":
                passed.add(parts[2].split("::")[-1])
        return sum(n in passed for n in names) / len(names)

    return code_tests


code_tests = make_code_tests()
