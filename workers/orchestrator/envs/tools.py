"""The tool-call format of agentic envs and its parser (never raises on model output).

Format (one call per model turn; text before it is free-form thinking, text after it is
ignored)::

    <tool name="run_tests"/>
    <tool name="read_file" path="calc.py"/>
    <tool name="write_file" path="calc.py">
    def add(a, b):
        return a + b
    </tool>
    <tool name="patch" path="calc.py">
    <<<<<<< SEARCH
        return a - b
    =======
        return a + b
    >>>>>>> REPLACE
    </tool>
    <tool name="submit"/>

Rules: attribute values are double-quoted; ``&quot; &lt; &gt; &amp;`` are the only
escapes. A body is the raw text between ``>`` and the first ``</tool>``; one leading
newline and one trailing newline are stripped (so the multi-line form above writes exactly
the two lines). Bodies therefore cannot contain the literal ``</tool>``.

Why this shape: XML-ish tags are what chat models already emit for tools (Hermes/Qwen
``<tool_call>``), but unlike JSON the file content needs no escaping, so a model writing
code never has to escape quotes or newlines. Why it never raises: the policy produces
arbitrary bytes; every malformed call becomes a :class:`ToolCallError` whose message is
shown to the model as the observation, so a bad call costs a turn, not the episode.
"""
from __future__ import annotations

import dataclasses
import html
import re
from typing import Optional, Union

OPEN = re.compile(r"<tool\b")
TAG = re.compile(r'<tool((?:\s+[A-Za-z_][A-Za-z0-9_]*\s*=\s*"[^"]*")*)\s*(/?)>')
ATTR = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"([^"]*)"')
CLOSE = "</tool>"
PATCH = re.compile(r"\A<<<<<<< SEARCH\n(.*?)\n?=======\n(.*?)\n?>>>>>>> REPLACE\s*\Z", re.S)


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    """A tool the env offers: required attributes (besides ``name``) and whether it takes a body."""

    name: str
    args: tuple[str, ...] = ()
    body: bool = False
    doc: str = ""

    def usage(self) -> str:
        attrs = "".join(f' {a}="..."' for a in self.args)
        return f'<tool name="{self.name}"{attrs}>...</tool>' if self.body else f'<tool name="{self.name}"{attrs}/>'


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    args: dict[str, str]
    body: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """A malformed call; ``message`` is the observation the model gets back."""

    message: str


def parse_tool_call(text: str, tools: dict[str, ToolSpec], *, max_body_chars: int = 65536
                    ) -> Union[ToolCall, ToolCallError, None]:
    """The first tool call in ``text``: a ToolCall, a ToolCallError, or None if there is none."""
    if not isinstance(text, str):
        return ToolCallError("tool call text is not a string")
    start = OPEN.search(text)
    if start is None:
        return None
    m = TAG.match(text, start.start())
    if m is None:
        return ToolCallError('malformed <tool ...> tag: write <tool name="NAME" key="value"/> '
                             f"(attributes double-quoted); tools: {usage(tools)}")
    attrs: dict[str, str] = {}
    for key, value in ATTR.findall(m.group(1)):
        if key in attrs:
            return ToolCallError(f"attribute {key!r} given twice")
        attrs[key] = html.unescape(value)
    name = attrs.pop("name", None)
    if name is None:
        return ToolCallError(f"tool call without name=\"...\"; tools: {usage(tools)}")
    spec = tools.get(name)
    if spec is None:
        return ToolCallError(f"unknown tool {name[:40]!r}; tools: {usage(tools)}")
    missing = [a for a in spec.args if a not in attrs]
    extra = sorted(set(attrs) - set(spec.args))
    if missing or extra:
        return ToolCallError(f"{name}: missing {missing} / unexpected {extra}; usage: {spec.usage()}")
    self_closing = m.group(2) == "/"
    if not spec.body:
        if not self_closing and not text.startswith(CLOSE, m.end()):
            return ToolCallError(f"{name} takes no body; usage: {spec.usage()}")
        return ToolCall(name, attrs)
    if self_closing:
        return ToolCallError(f"{name} needs a body; usage: {spec.usage()}")
    end = text.find(CLOSE, m.end())
    if end < 0:
        return ToolCallError(f"{name}: body not closed with {CLOSE} (the turn may have hit its token limit)")
    body = text[m.end():end]
    if body.startswith("\n"):
        body = body[1:]
    if body.endswith("\n"):
        body = body[:-1]
    if len(body) > max_body_chars:
        return ToolCallError(f"{name}: body of {len(body)} chars exceeds the limit of {max_body_chars}")
    return ToolCall(name, attrs, body)


def parse_patch(body: str) -> Union[tuple[str, str], ToolCallError]:
    """``<<<<<<< SEARCH / ======= / >>>>>>> REPLACE`` body -> (old, new)."""
    m = PATCH.match(body)
    if m is None:
        return ToolCallError("patch body must be:\n<<<<<<< SEARCH\nold lines\n=======\nnew lines\n>>>>>>> REPLACE")
    old, new = m.group(1), m.group(2)
    if not old:
        return ToolCallError("patch: the SEARCH part is empty")
    return old, new


def usage(tools: dict[str, ToolSpec]) -> str:
    return " ".join(spec.usage() for spec in tools.values())
