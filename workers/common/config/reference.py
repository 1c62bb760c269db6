"""docs/config.md, generated: every config key with its type, default, range and docstring.

Run ``python -m workers.common.config.reference --write`` after changing a schema (without
``--write`` it prints the page). tests/unit/common/test_config_reference.py fails when docs/config.md is
not what this module renders, so the reference cannot drift from the dataclasses.

Why generated from the dataclasses: they are the schema every role loads, the ranges are the
``limits(...)`` rules declared beside them (workers/common/config/ranges.py), and the field
docstrings are the only prose about each key. Python keeps no field docstrings at run time, so they
are read from the schema's source with ``ast``. The four plugin sections (``model``, ``inference``,
``weights``, ``env``) take the schema of the entry they name; each schema class is listed once with
the fields it adds or whose default it changes, and says which entries use it. Torch-free.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING

from workers.common.config import RunConfig
from workers.common.config.ranges import Each, OneOf, Pattern, Range, Text, rule_for
from workers.common.registry import SECTIONS

OUT = Path(__file__).resolve().parents[3] / "docs" / "config.md"
COMMAND = "python -m workers.common.config.reference --write"


def field_docs(schema: type) -> dict[str, str]:
    """Field name -> docstring (the string literal right after the field), over the schema's MRO."""
    docs: dict[str, str] = {}
    for cls in reversed(schema.__mro__):
        if not dataclasses.is_dataclass(cls) or cls is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for stmt, nxt in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[stmt.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


def describe_rule(rule: Any) -> str:
    if rule is None:
        return ""
    if isinstance(rule, Range):
        return rule.describe()
    if isinstance(rule, OneOf):
        return "one of " + ", ".join(f"`{c}`" for c in rule.choices)
    if isinstance(rule, Pattern):
        return rule.what
    if isinstance(rule, Text):
        return "text"
    if isinstance(rule, Each):
        n = f"{rule.length} items, " if rule.length is not None else ""
        return f"{n}each {describe_rule(rule.rule)}"
    return type(rule).__name__


def type_name(hint: Any) -> str:
    if hint is type(None):
        return "None"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        return " | ".join(type_name(a) for a in args)
    if origin in (list, dict, tuple):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    if hint is Any:
        return "section"
    return getattr(hint, "__name__", str(hint))


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return MISSING


def show_default(value: Any) -> str:
    if value is MISSING or value == MISSING:
        return "required"
    if dataclasses.is_dataclass(value):
        return "(section)"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{value!r}`"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def rows(schema: type, prefix: str, names: Optional[set] = None) -> list[str]:
    """Table rows for ``schema``'s fields (only ``names`` when given); nested sections recurse."""
    hints, docs, out = typing.get_type_hints(schema), field_docs(schema), []
    for f in dataclasses.fields(schema):
        if names is not None and f.name not in names:
            continue
        key, default = f"{prefix}{f.name}", default_of(f)
        if dataclasses.is_dataclass(default) and not isinstance(default, type) and hints[f.name] is not Any:
            out += rows(type(default), key + ".")
            continue
        out.append(f"| `{key}` | {cell(type_name(hints[f.name]))} | {cell(show_default(default))} | "
                   f"{cell(describe_rule(rule_for(schema, f.name)))} | {cell(docs.get(f.name, ''))} |")
    return out


HEADER = "| key | type | default | range | what |\n| --- | --- | --- | --- | --- |"


def table(schema: type, prefix: str, names: Optional[set] = None) -> str:
    body = rows(schema, prefix, names)
    return HEADER + "\n" + "\n".join(body) if body else "(no fields of its own)"


def own_fields(schema: type) -> set:
    """Fields ``schema`` adds to its dataclass parent, or whose default it changes."""
    parent = next((b for b in schema.__mro__[1:] if dataclasses.is_dataclass(b)), None)
    if parent is None:
        return {f.name for f in dataclasses.fields(schema)}
    base = {f.name: f for f in dataclasses.fields(parent)}
    out = set()
    for f in dataclasses.fields(schema):
        if f.name not in base:
            out.add(f.name)
            continue
        a, b = default_of(f), default_of(base[f.name])
        if not dataclasses.is_dataclass(a) and (a is MISSING) != (b is MISSING) or (a is not MISSING and a != b):
            out.add(f.name)
    return out


def plugin_section(section: str) -> str:
    key, registry = SECTIONS[section]
    specs = [s for s in registry.specs() if s.config.__module__.startswith("workers.")]
    users: dict[type, list[str]] = {}
    for spec in specs:
        for cls in spec.config.__mro__:
            if dataclasses.is_dataclass(cls):
                users.setdefault(cls, []).append(spec.name)
    order = sorted(users, key=lambda c: (len([b for b in c.__mro__ if dataclasses.is_dataclass(b)]), c.__name__))
    parts = [f"## `{section}`\n\nThe schema is chosen by `{section}.{key}` "
             f"({', '.join(f'`{n}`' for n in sorted(s.name for s in specs))}). Each class below lists the "
             f"fields it adds to its parent, or whose default it changes; an entry has every field of its "
             f"class and of the classes it extends."]
    for cls in order:
        parent = next((b for b in cls.__mro__[1:] if dataclasses.is_dataclass(b)), None)
        extends = f", extends `{parent.__name__}`" if parent else ""
        used = ", ".join(f"`{n}`" for n in sorted(users[cls]))
        parts.append(f"### `{cls.__name__}` ({cls.__module__}{extends})\n\nUsed by {section}.{key} = {used}.\n\n"
                     + table(cls, f"{section}.", own_fields(cls)))
    return "\n\n".join(parts)


def render() -> str:
    hints = typing.get_type_hints(RunConfig)
    plain = [f.name for f in dataclasses.fields(RunConfig) if not dataclasses.is_dataclass(hints[f.name])
             and f.name not in SECTIONS]
    nested = [f.name for f in dataclasses.fields(RunConfig) if dataclasses.is_dataclass(hints[f.name])]
    parts = [
        "# Config reference",
        f"<!-- Generated by `{COMMAND}` from the config dataclasses; do not edit by hand "
        "(tests/unit/common/test_config_reference.py fails when this file is stale). -->",
        "Every key of a run's config (`config/run.yaml` in a run directory), with its type, default, the range or "
        "choices the plan enforces (`limits(...)` beside each schema, workers/common/config/ranges.py) and its "
        "docstring. Set any of them as a Hydra override (`trainer.lr=3e-6`) or in a YAML of `hydra_conf/`. "
        "`required`: the value has no default (a preset or the command line gives it). Non-finite numbers are "
        "refused everywhere. How the sections fit together: [design.md](design.md#configuration).",
        "## Top level\n\n" + table(RunConfig, "", set(plain)),
    ]
    parts += [f"## `{name}`\n\n" + table(hints[name], f"{name}.") for name in nested]
    parts += [plugin_section(section) for section in SECTIONS]
    return "\n\n".join(parts) + "\n"


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {OUT} instead of printing")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        OUT.write_text(text)
        print(f"wrote {OUT} ({len(text.splitlines())} lines)")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
