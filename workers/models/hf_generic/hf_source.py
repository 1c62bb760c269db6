"""What transformers knows about a config.json, read from its SOURCE files: no import, no torch.

Why not ``AutoConfig``: importing ``transformers.configuration_utils`` (and so
``transformers.models.auto.configuration_auto``) imports torch, and the launcher never does
(tests/unit/repo/test_import_graph.py). The facts the plan needs are literals in transformers'
own files, so they are parsed with :mod:`ast` from the installed package:

- ``models/auto/modeling_auto.py``: ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (model_type ->
  ``AutoModelForCausalLM`` class): which checkpoints the generic path can build;
- ``models/auto/auto_mappings.py``: ``CONFIG_MAPPING_NAMES`` (model_type -> config class) and
  ``SPECIAL_MODEL_TYPE_TO_MODULE_NAME`` (where its module lives);
- ``models/<module>/configuration_<module>.py``: the config class's ``attribute_map`` (GPT-2's
  ``n_embd`` is ``hidden_size``) and its class-level defaults (transformers 5 configs are
  dataclasses), so a key a config.json leaves out means what it means in transformers.

Every function returns None / {} when transformers (or one of these literals) is absent, and the
caller says what is missing. Results are cached per process (the files do not change under it).
"""
from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path
from typing import Any, Optional

STANDARD = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "max_position_embeddings", "tie_word_embeddings", "sliding_window")
"""transformers' standard config attribute names this path reads (through ``attribute_map``)."""


@functools.lru_cache(maxsize=1)
def transformers_dir() -> Optional[Path]:
    """The installed transformers package directory (found, not imported), or None."""
    try:
        spec = importlib.util.find_spec("transformers")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def transformers_version() -> str:
    """The installed version string ("" when absent), from its ``__init__.py`` literal."""
    root = transformers_dir()
    if root is None:
        return ""
    for node in _module(root / "__init__.py"):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__version__" for t in node.targets):
            return str(ast.literal_eval(node.value))
    return ""


@functools.lru_cache(maxsize=64)
def _module(path: Path) -> tuple:
    """Top-level statements of a source file (empty when unreadable)."""
    try:
        return tuple(ast.parse(path.read_text(encoding="utf-8")).body)
    except (OSError, SyntaxError, UnicodeDecodeError):
        return ()


def _literal_mapping(path: Path, name: str) -> dict:
    """``NAME = OrderedDict([...])`` or ``NAME = {...}`` at the top of ``path`` as a dict (later
    ``NAME.update({...})`` calls of literals applied); {} when absent."""
    out: dict = {}
    for node in _module(path):
        value = None
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == name for t in node.targets):
            value = node.value
            if isinstance(value, ast.Call) and value.args:  # OrderedDict([...]) / OrderedDict(**{...}, **NAME)
                value = value.args[0]
            out = {}
        elif (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
              and isinstance(node.value.func, ast.Attribute) and node.value.func.attr == "update"
              and getattr(node.value.func.value, "id", "") == name and node.value.args):
            value = node.value.args[0]
        if value is None:
            continue
        try:
            out.update(dict(ast.literal_eval(value)))
        except (ValueError, TypeError, SyntaxError):
            continue
    return out


@functools.lru_cache(maxsize=1)
def causal_lm_classes() -> dict[str, str]:
    """model_type -> the ``AutoModelForCausalLM`` class name transformers builds for it ({}: no transformers)."""
    root = transformers_dir()
    if root is None:
        return {}
    return _literal_mapping(root / "models" / "auto" / "modeling_auto.py", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")


@functools.lru_cache(maxsize=256)
def config_facts(model_type: str) -> tuple[dict[str, str], dict[str, Any]]:
    """(``attribute_map``, {field: literal class default}) of ``model_type``'s config class; ({}, {})
    when it cannot be found. Defaults that are not literals (factories, expressions) are left out."""
    root = transformers_dir()
    if root is None:
        return {}, {}
    auto = root / "models" / "auto"
    class_name = module = None
    for mappings in (auto / "auto_mappings.py", auto / "configuration_auto.py"):  # newer / older transformers
        class_name = class_name or _literal_mapping(mappings, "CONFIG_MAPPING_NAMES").get(model_type)
        module = module or _literal_mapping(mappings, "SPECIAL_MODEL_TYPE_TO_MODULE_NAME").get(model_type)
    module = module or model_type.replace("-", "_")
    if not class_name:
        return {}, {}
    for node in _module(root / "models" / module / f"configuration_{module}.py"):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return _class_facts(node)
    return {}, {}


def _class_facts(cls: ast.ClassDef) -> tuple[dict[str, str], dict[str, Any]]:
    """Class-level literals (transformers 5's dataclass configs) and ``__init__`` keyword defaults (older ones)."""
    attribute_map: dict[str, str] = {}
    defaults: dict[str, Any] = {}
    for stmt in cls.body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
            args = stmt.args.args[len(stmt.args.args) - len(stmt.args.defaults):] + stmt.args.kwonlyargs
            values = list(stmt.args.defaults) + list(stmt.args.kw_defaults)
            for arg, value in zip(args, values):
                if value is None:  # a keyword-only argument without a default
                    continue
                try:
                    defaults.setdefault(arg.arg, ast.literal_eval(value))
                except (ValueError, TypeError, SyntaxError):
                    continue
        target, value = None, None
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            target, value = stmt.target.id, stmt.value
        elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            target, value = stmt.targets[0].id, stmt.value
        if target is None:
            continue
        try:
            literal = ast.literal_eval(value)
        except (ValueError, TypeError, SyntaxError):
            continue
        if target == "attribute_map" and isinstance(literal, dict):
            attribute_map = {str(k): str(v) for k, v in literal.items()}
        elif not target.startswith("_"):
            defaults[target] = literal
    return attribute_map, defaults


def standard_values(config: dict) -> dict[str, Any]:
    """{standard name: value} of a config.json as transformers reads it: the key itself, else its
    ``attribute_map`` spelling, else the config class's default (absent: not in the result)."""
    attribute_map, defaults = config_facts(str(config.get("model_type", "")))
    out: dict[str, Any] = {}
    for name in STANDARD:
        spelled = attribute_map.get(name, name)
        for key in (name, spelled):
            if key in config:
                out[name] = config[key]
                break
        else:
            for key in (name, spelled):
                if key in defaults:
                    out[name] = defaults[key]
                    break
    return out
