"""Reward functions named by import path (``env.reward_fn=my_package.rewards:score``), and how they run.

A reward is a plain Python function of the user's::

    def score(prompt: str, completion: str, sample: dict) -> float      # or ``async def``

``prompt`` is the user message (the record's prompt or filled template), ``completion`` the
model's answer as text (decoded without special tokens, outer whitespace stripped), ``sample`` the record's fields (plus ``answer``: the ``env.answer_key``
field). The target may also be a dict of such functions (``REWARDS = {"format": f, "correct":
g}``): the reward is their sum and each is logged as ``reward/<name>`` in metrics.jsonl.

Built-ins, by short name or by path: ``exact_match``, ``math_equal`` (rewards/answers.py) and
``code_tests`` (rewards/code_tests.py: the completion's code against the sample's tests in the
sandbox).

Plan time (:func:`load_reward`, called by the launcher on the login node): the module is
IMPORTED there, so its top-level code runs with the user's rights on the login node (it is the
user's own code, as a training script would be); an import error, a missing name or a wrong
signature is refused with the path named, before anything is submitted. Nothing here imports
torch (the launcher must stay torch-free); the user's module may, at its own import cost.

Run time (:class:`RewardRunner`): each function runs under ``env.reward_timeout_s``; a sync one
in a daemon thread (a hung function keeps its thread but never the event loop, nor the process
exit), an async one on the loop. A timeout, an exception, or a value that is not a finite number
scores 0 for that function and is returned as a named failure, which the env counts
(``reward_failures`` in metrics) and logs: never a crash, never a silent zero.
"""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import threading
from numbers import Real
from typing import Any, Callable

from workers.common.import_path import import_object

TIMED_OUT = "timed out"
"""How a timed-out call's failure line starts (counted apart as ``reward_timeouts``)."""
BUILTINS = {
    "exact_match": "workers.orchestrator.rewards.answers:exact_match",
    "math_equal": "workers.orchestrator.rewards.answers:math_equal",
    "code_tests": "workers.orchestrator.rewards.code_tests:code_tests",
}


@dataclasses.dataclass(frozen=True)
class Reward:
    """The loaded target of ``env.reward_fn``: one function (name "") or named functions."""

    spec: str
    functions: dict[str, Callable]

    @property
    def named(self) -> bool:
        return list(self.functions) != [""]


def load_reward(spec: str, *, key: str = "env.reward_fn") -> Reward:
    """Import ``module:name`` (or a built-in short name); ValueError naming ``key`` and the path."""
    target = BUILTINS.get(spec, spec)
    if target.count(":") != 1 or not all(target.split(":")):
        raise ValueError(f"{key}={spec!r}: write 'module.path:function' (a function or dict of functions on "
                         f"PYTHONPATH) or a built-in: {sorted(BUILTINS)}")
    obj = import_object(target, key=key)
    if callable(obj):
        functions = {"": obj}
    elif isinstance(obj, dict) and obj and all(isinstance(k, str) and k and callable(v) for k, v in obj.items()):
        functions = dict(obj)
    else:
        raise ValueError(f"{key}={spec!r} is a {type(obj).__name__}: it must be a function (prompt, completion, "
                         f"sample) -> float or a non-empty dict of name -> such function")
    for name, fn in functions.items():
        try:
            inspect.signature(fn).bind("prompt", "completion", {})
        except TypeError as e:
            raise ValueError(f"{key}={spec!r}{f' [{name!r}]' if name else ''}: {getattr(fn, '__name__', fn)} cannot be "
                             f"called as f(prompt, completion, sample): {e}") from None
        except ValueError:  # builtins without a signature: trust them
            pass
    return Reward(spec, functions)


@dataclasses.dataclass
class Score:
    total: float
    """Sum of every function's value (0 for a failed one)."""
    parts: dict[str, float]
    """name -> value, for a dict of rewards (empty for a single function)."""
    failures: list[str]
    """One line per failed function: ``name: why`` (timeout, exception, not a finite number)."""


class RewardRunner:
    """Runs a :class:`Reward` with a timeout per function; never raises for the user's errors."""

    def __init__(self, reward: Reward, *, timeout_s: float):
        self.reward, self.timeout_s = reward, timeout_s

    async def score(self, prompt: str, completion: str, sample: dict) -> Score:
        names = list(self.reward.functions)
        results = await asyncio.gather(*(self._one(self.reward.functions[n], prompt, completion, sample) for n in names))
        parts, failures = {}, []
        for name, (value, error) in zip(names, results):
            if error is not None:
                failures.append(f"{name or self.reward.spec}: {error}")
            parts[name] = value
        total = float(sum(parts.values()))
        return Score(total, parts if self.reward.named else {}, failures)

    async def _one(self, fn: Callable, *args) -> tuple[float, str | None]:
        try:
            if inspect.iscoroutinefunction(fn):
                value = await asyncio.wait_for(fn(*args), self.timeout_s)
            else:
                value = await asyncio.wait_for(_in_thread(fn, *args), self.timeout_s)
                if inspect.isawaitable(value):  # a sync wrapper that returned a coroutine
                    value = await asyncio.wait_for(value, self.timeout_s)
        except asyncio.TimeoutError:
            return 0.0, f"{TIMED_OUT} after {self.timeout_s}s (env.reward_timeout_s)"
        except Exception as e:  # the user's function failed: a counted failure, not a crash
            return 0.0, f"raised {type(e).__name__}: {str(e)[:300]}"
        if isinstance(value, bool) or not isinstance(value, Real):
            return 0.0, f"returned {type(value).__name__} {str(value)[:80]!r}, not a number"
        if not math.isfinite(float(value)):
            return 0.0, f"returned {value}, not a finite number"
        return float(value), None


def _in_thread(fn: Callable, *args) -> "asyncio.Future":
    """``fn(*args)`` in a daemon thread: a hung function cannot block the loop or the process exit
    (a ThreadPoolExecutor's workers are joined at exit)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if fut.done():  # timed out and cancelled meanwhile
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)

    def work() -> None:
        try:
            value, error = fn(*args), None
        except Exception as e:  # handed to the awaiting coroutine
            value, error = None, e
        except BaseException as e:  # noqa: BLE001 - SystemExit & co. from user code: a failure like any other
            value, error = None, RuntimeError(f"{type(e).__name__}: {e}")
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop closed while the function ran
            pass

    threading.Thread(target=work, name=f"reward-{getattr(fn, '__name__', 'fn')}", daemon=True).start()
    return fut
