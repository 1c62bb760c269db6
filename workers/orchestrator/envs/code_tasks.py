"""Seeded generator of tiny buggy Python projects for the code_repair env.

A task is a module (``calc.py``) with ``num_functions`` functions, each with one injected
bug (an operator or constant mutation of a correct template), plus ``test_calc.py``
with ``num_tests_per_function`` test functions per function. Test inputs are drawn from
the seed; expected values come from the *correct* template, evaluated here (trusted code,
never the model's). Cases are chosen so that the bug fails at least one test of its
function, and passes at least one when such inputs exist, so partial credit is possible.

Why generated rather than a fixed dataset: unlimited distinct tasks from a seed, no data
files, deterministic tests, and the reference fix is known (``Task.solution``) so
integration tests can check that a perfect agent earns reward 1.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable

#: name, correct source, (before, after) mutations, input generator(rng) -> args tuple
TEMPLATES: list[tuple[str, str, list[tuple[str, str]], Callable[[random.Random], tuple]]] = [
    ("add", "def add(a, b):\n    return a + b\n", [("a + b", "a - b"), ("a + b", "a + b + 1")],
     lambda r: (r.randint(-9, 9), r.randint(-9, 9))),
    ("is_even", "def is_even(n):\n    return n % 2 == 0\n", [("== 0", "== 1"), ("% 2", "% 3")],
     lambda r: (r.randint(0, 30),)),
    ("clamp", "def clamp(x, lo, hi):\n    if x < lo:\n        return lo\n    if x > hi:\n        return hi\n    return x\n",
     [("return lo", "return hi"), ("x > hi", "x < hi")], lambda r: (r.randint(-5, 15), 0, 10)),
    ("maximum", "def maximum(xs):\n    best = xs[0]\n    for x in xs:\n        if x > best:\n            best = x\n"
                "    return best\n", [("x > best", "x < best"), ("best = xs[0]", "best = 0")],
     lambda r: ([r.randint(-9, 9) for _ in range(r.randint(1, 4))],)),
    ("count", "def count(xs, v):\n    n = 0\n    for x in xs:\n        if x == v:\n            n += 1\n    return n\n",
     [("n += 1", "n += 2"), ("x == v", "x != v")],
     lambda r: ([r.randint(0, 3) for _ in range(r.randint(0, 5))], r.randint(0, 3))),
    ("sum_to", "def sum_to(n):\n    return n * (n + 1) // 2\n", [("(n + 1)", "(n - 1)"), ("// 2", "// 3")],
     lambda r: (r.randint(0, 12),)),
    ("reverse", "def reverse(s):\n    return s[::-1]\n", [("s[::-1]", "s[::1]"), ("s[::-1]", "s[1::-1]")],
     lambda r: ("".join(r.choice("abc") for _ in range(r.randint(0, 4))),)),
    ("factorial", "def factorial(n):\n    out = 1\n    for i in range(2, n + 1):\n        out *= i\n    return out\n",
     [("n + 1", "n"), ("out = 1", "out = 0")], lambda r: (r.randint(0, 6),)),
]
MODULES = ("calc", "util", "mathx", "helpers")


@dataclasses.dataclass(frozen=True)
class TestCase:
    function: str
    args: tuple
    expected: Any

    def source(self, index: int) -> str:
        call = f"{self.function}({', '.join(map(repr, self.args))})"
        return f"def test_{self.function}_{index}():\n    assert {call} == {self.expected!r}\n"


@dataclasses.dataclass(frozen=True)
class Task:
    task_id: int
    module: str
    files: dict[str, str]
    """Initial project: buggy module + test file."""
    solution: dict[str, str]
    """The module as it should be (reference fix; never shown to the model)."""
    test_file: str
    test_names: tuple[str, ...]
    """Every test the reward counts; ones the runner does not report count as failed."""

    @property
    def module_file(self) -> str:
        return f"{self.module}.py"


def _call(src: str, name: str, args: tuple) -> tuple[bool, Any]:
    scope: dict[str, Any] = {}
    exec(src, scope)  # noqa: S102 - template code from this file, not model output
    try:
        return True, scope[name](*args)
    except Exception as e:  # noqa: BLE001 - a mutation may raise (IndexError, ...)
        return False, type(e).__name__


def make_task(task_id: int, rng: random.Random, *, num_functions: int, num_tests: int) -> Task:
    """One project; everything is drawn from ``rng`` (deterministic per seed)."""
    chosen = rng.sample(range(len(TEMPLATES)), k=min(num_functions, len(TEMPLATES)))
    module = rng.choice(MODULES)
    good_parts, bad_parts, tests = [], [], []
    for t in chosen:
        name, src, mutations, gen = TEMPLATES[t]
        before, after = rng.choice(mutations)
        bad = src.replace(before, after, 1)
        assert bad != src, f"mutation {before!r} does not apply to {name}"
        failing, passing = [], []
        for _ in range(40):  # draw inputs until the bug is caught (and, if possible, some pass)
            args = gen(rng)
            ok, expected = _call(src, name, args)
            if not ok:
                continue
            bad_ok, got = _call(bad, name, args)
            (passing if bad_ok and got == expected else failing).append(TestCase(name, args, expected))
            if len(failing) >= 1 and len(passing) >= num_tests - 1:
                break
        assert failing, f"no input exposes the bug {before!r} -> {after!r} in {name}"
        cases = (failing[:1] + passing[: num_tests - 1] + failing[1:])[:num_tests]
        rng.shuffle(cases)
        tests += cases
        good_parts.append(src)
        bad_parts.append(bad)
    names = [f"test_{c.function}_{i}" for i, c in enumerate(tests)]
    test_src = f"from {module} import {', '.join(TEMPLATES[t][0] for t in chosen)}\n\n\n" + "\n\n".join(
        c.source(i) for i, c in enumerate(tests))
    test_file = f"test_{module}.py"
    return Task(task_id=task_id, module=module, files={f"{module}.py": "\n\n".join(bad_parts), test_file: test_src},
                solution={f"{module}.py": "\n\n".join(good_parts)}, test_file=test_file, test_names=tuple(names))
