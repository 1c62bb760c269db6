"""Objects named by import path in a config (``env.reward_fn=my_pkg.rewards:score``,
``env._target_=my_pkg.envs:MyEnv``), imported the same way everywhere, with errors that name the key.

The one place that imports by path: user objects named in a config (:func:`import_object`, errors
that name the key) and the project's own lazy references, ``"package.module:name"`` strings that
keep role code (torch) out of the torch-free specs the launcher reads (:func:`lazy`).

Both spellings work: ``module.path:attr`` (the attribute may be dotted: ``mod:Outer.inner``) and
Hydra's ``module.path.attr`` (split at the last dot). The module is imported in this process:
on the login node at plan time, which is the user's own code running with the user's rights (as
a training script would); an import error, a missing name or a module off PYTHONPATH is a
ValueError naming ``key``, the path and the module's file, before anything is submitted.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable


def split_target(target: str, *, key: str, example: str) -> tuple[str, str]:
    """(module, attribute) of ``module:attr`` or ``module.attr``; ValueError naming ``key`` otherwise."""
    if target.count(":") == 1 and all(target.split(":")):
        module, attr = target.split(":")
        return module, attr
    if ":" not in target and "." in target.strip(".") and all(target.split(".")):
        module, attr = target.rsplit(".", 1)
        return module, attr
    raise ValueError(f"{key}={target!r}: write an import path such as {example!r} (module on PYTHONPATH, "
                     f"then ':' or '.', then the name)")


def lazy(target: str) -> Callable[..., Any]:
    """``"package.module:name"`` -> a function that imports the module on its first call and
    calls ``name`` with the same arguments (keeps role code out of a spec's imports)."""
    module, _, name = target.partition(":")

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__qualname__ = call.__name__ = f"lazy[{target}]"
    return call


def import_object(target: str, *, key: str, example: str = "my_package.module:name") -> Any:
    """The object ``target`` names; ValueError naming ``key`` when its module or attribute is missing."""
    module_name, attr = split_target(target, key=key, example=example)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the user's module may fail in any way at import
        raise ValueError(f"{key}={target!r}: cannot import module {module_name!r} ({type(e).__name__}: {e}); "
                         f"is its directory on PYTHONPATH?") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{key}={target!r}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no "
                             f"attribute {attr!r}")
        obj = getattr(obj, part)
    return obj
