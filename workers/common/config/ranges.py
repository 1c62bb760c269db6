"""Ranges and choices of config fields: small declarative rules per schema, one generic checker.

Why tables instead of hand-written checks: every numeric field needs a range and every string
field its choices, across a dozen schemas and every plugin's. A rule per field, declared next
to the schema that owns it (``limits(TrainerConfig, lr=gt(0), ...)`` at the bottom of its file,
a plugin in its own home), keeps that to one line a field; :func:`check_fields` walks a section
(nested dataclasses, lists and dicts included) and raises :class:`ConfigError` naming the full
key, the value and the valid range. ``tests/unit/common/test_config_ranges.py`` walks every registered
schema and fails on a number or string without a rule, so a new field cannot skip this.

Non-finite floats (inf, nan) are refused wherever a number is checked, with or without a rule:
no field of ours means infinity. Cross-field rules (top_k <= num_experts, ports that fit) stay
in the plan and the plugins' checks; these are the per-field facts. Pure, torch-free.
"""
from __future__ import annotations

import dataclasses
import math
import re
import typing
from typing import Any, Collection, Optional, Union


class ConfigError(ValueError):
    """A config value is out of range, not one of its choices, or a field the section's schema does
    not have; the message names the key. The CLI prints it as ``slurmrl: error: ...`` (exit 2)."""


@dataclasses.dataclass(frozen=True)
class Range:
    """``lo <= value <= hi`` (open ends with ``lo_open``/``hi_open``); ``also``: extra valid values
    (sentinels such as ``dp=-1``). Always finite."""

    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False
    also: tuple = ()

    def describe(self) -> str:
        """``> 0``, ``>= 1``, ``in [0, 1)``, ``any number``; `` or -1`` for each sentinel."""
        if self.lo is not None and self.hi is not None:
            text = f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        elif self.lo is not None:
            text = f"{'>' if self.lo_open else '>='} {self.lo:g}"
        elif self.hi is not None:
            text = f"{'<' if self.hi_open else '<='} {self.hi:g}"
        else:
            text = "any number"
        return text + "".join(f" or {a}" for a in self.also)

    def error(self, value: Any) -> Optional[str]:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a number {self.describe()}"
        if value in self.also:
            return None
        if not math.isfinite(value):
            return f"must be a finite number {self.describe()}"
        if ((self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo)))
                or (self.hi is not None and (value > self.hi or (self.hi_open and value == self.hi)))):
            return f"must be {self.describe()}"
        return None


@dataclasses.dataclass(frozen=True)
class OneOf:
    """A string from a fixed set."""

    choices: tuple

    def error(self, value: Any) -> Optional[str]:
        return None if value in self.choices else f"is not supported; choose one of {list(self.choices)}"


@dataclasses.dataclass(frozen=True)
class Pattern:
    """A string matching ``regex`` in full; ``what`` says what it means."""

    regex: str
    what: str

    def error(self, value: Any) -> Optional[str]:
        return None if isinstance(value, str) and re.fullmatch(self.regex, value) else f"must be {self.what}"


@dataclasses.dataclass(frozen=True)
class Text:
    """Free text (names, paths, shell lines): nothing to check beyond its type."""

    def error(self, value: Any) -> Optional[str]:
        return None


@dataclasses.dataclass(frozen=True)
class Each:
    """Every item of a list (or every value of a dict) meets ``rule``; ``length``: exact list length."""

    rule: Any
    length: Optional[int] = None

    def error(self, value: Any) -> Optional[str]:
        items = list(value.values()) if isinstance(value, dict) else list(value)
        if self.length is not None and len(items) != self.length:
            return f"must have {self.length} items"
        for item in items:
            why = self.rule.error(item)
            if why:
                return f"has {item!r}: each item {why}"
        return None


Rule = Union[Range, OneOf, Pattern, Text, Each]
TEXT = Text()
ANY_NUMBER = Range()
"""Any finite number (a field whose sign means something, e.g. a seed offset)."""
NONEMPTY = Pattern(r".+", "a non-empty string")
LINE = Pattern(r"[^\n\r\x00]*", "one line of text (no newline, carriage return or NUL: it lands in a line of the "
                                  "sbatch script)")


def gt(lo: float, *, also: tuple = ()) -> Range:
    return Range(lo=lo, lo_open=True, also=also)


def ge(lo: float, *, also: tuple = ()) -> Range:
    return Range(lo=lo, also=also)


def between(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> Range:
    return Range(lo=lo, hi=hi, lo_open=lo_open, hi_open=hi_open)


def one_of(*choices: str) -> OneOf:
    return OneOf(tuple(choices))


SEED = between(0, 2**63 - 1)
"""Seeds: what torch.Generator.manual_seed and random.Random take alike."""


RULES: dict[type, dict[str, Rule]] = {}
"""schema class -> field -> rule; a subclass inherits its bases' rules and may override them."""


def limits(schema: type, **rules: Rule) -> None:
    """Declare the rules of ``schema``'s own fields (call it next to the schema, at import)."""
    names = {f.name for f in dataclasses.fields(schema)}
    unknown = sorted(set(rules) - names)
    if unknown:
        raise TypeError(f"limits({schema.__name__}): no such fields {unknown}")
    RULES.setdefault(schema, {}).update(rules)


def rule_for(schema: type, name: str) -> Optional[Rule]:
    for cls in schema.__mro__:
        if name in RULES.get(cls, {}):
            return RULES[cls][name]
    return None


def _errors(obj: Any, prefix: str, skip: Collection[str] = ()) -> list[str]:
    out = []
    for f in dataclasses.fields(obj):
        if f.name in skip:
            continue
        key, value = f"{prefix}.{f.name}" if prefix else f.name, getattr(obj, f.name)
        if value is None:  # Optional fields: None means "the default"; OmegaConf refuses None elsewhere
            continue
        if dataclasses.is_dataclass(value):
            out += _errors(value, key)
            continue
        rule = rule_for(type(obj), f.name)
        why = rule.error(value) if rule is not None else _nonfinite(value)
        if why:  # numbers: "trainer.lr must be > 0, got -1.0"; strings: "inference.device='tpu' must be ..."
            out.append(f"{key}={value!r} {why}" if isinstance(value, str) else f"{key} {why}, got {value}")
    return out


def _nonfinite(value: Any) -> Optional[str]:
    """No rule: still refuse inf / nan anywhere (a plugin schema without a table included)."""
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if isinstance(item, float) and not math.isfinite(item):
            return "must be a finite number"
    return None


def positive(key: str, value: float, *, allow_zero: bool = False) -> None:
    """``value > 0`` (``>= 0`` with ``allow_zero``), else ConfigError naming ``key``: for a check that
    spans fields (a difference, a derived size) or is asked only in some modes, where a per-field rule
    of :func:`limits` cannot say it."""
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def check_fields(obj: Any, prefix: str, *, skip: Collection[str] = ()) -> None:
    """Every field of the dataclass ``obj`` (section ``prefix``; "" for the whole run) but ``skip``
    meets its rule; raises ConfigError naming the first key that does not, its value and what is valid."""
    errors = _errors(obj, prefix, skip)
    if errors:
        raise ConfigError(errors[0])


def unruled_fields(schema: type, prefix: str = "") -> list[str]:
    """Numeric and string fields (nested, in lists and dicts too) of ``schema`` with no rule: the
    completeness test's question. Booleans need none (the schema's type is the whole rule)."""
    hints = typing.get_type_hints(schema)
    out = []
    for f in dataclasses.fields(schema):
        key, hint = f"{prefix}{f.name}", hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        base = args[0] if typing.get_origin(hint) is Union and len(args) == 1 else hint
        if dataclasses.is_dataclass(base):
            out += unruled_fields(base, key + ".")
            continue
        leaf = typing.get_args(base)[-1] if typing.get_origin(base) in (list, dict) else base
        if leaf in (int, float, str) and rule_for(schema, f.name) is None:
            out.append(key)
    return out
