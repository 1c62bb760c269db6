"""Tool-call format: good calls parse, every kind of bad input becomes a ToolCallError (never raises)."""
from __future__ import annotations

import random

import pytest

from workers.orchestrator.envs.chat import ASSISTANT, BOS, EOT, TOOL, USER, VOCAB_SIZE, ByteTokenizer, ChatTemplate
from workers.orchestrator.envs.code_repair import TOOLS
from workers.orchestrator.envs.tools import ToolCall, ToolCallError, parse_patch, parse_tool_call


def parse(text):
    return parse_tool_call(text, TOOLS, max_body_chars=200)


def test_good_calls():
    assert parse('<tool name="run_tests"/>') == ToolCall("run_tests", {})
    assert parse('thinking... <tool name="read_file" path="calc.py"/> trailing') == ToolCall("read_file", {"path": "calc.py"})
    assert parse('<tool name="run_tests"></tool>') == ToolCall("run_tests", {})
    call = parse('<tool name="write_file" path="a.py">\ndef f():\n    return "x"\n</tool>')
    assert call == ToolCall("write_file", {"path": "a.py"}, 'def f():\n    return "x"')
    assert parse('<tool  name = "read_file"  path="&quot;q&quot;.py" />').args == {"path": '"q".py'}
    assert parse("no call at all") is None
    assert parse("") is None


@pytest.mark.parametrize("text, fragment", [
    ("<tool", "malformed"),
    ("<tool name=run_tests/>", "malformed"),
    ('<tool name="run_tests"', "malformed"),
    ("<tool/>", "without name"),
    ('<tool name="rm_rf"/>', "unknown tool"),
    ('<tool name="read_file"/>', "missing ['path']"),
    ('<tool name="read_file" path="a" mode="w"/>', "unexpected ['mode']"),
    ('<tool name="read_file" path="a" path="b"/>', "given twice"),
    ('<tool name="write_file" path="a.py"/>', "needs a body"),
    ('<tool name="write_file" path="a.py">never closed', "not closed"),
    ('<tool name="run_tests">body</tool>', "takes no body"),
    ('<tool name="write_file" path="a.py">' + "x" * 300 + "</tool>", "exceeds the limit"),
])
def test_bad_calls_become_error_observations(text, fragment):
    out = parse(text)
    assert isinstance(out, ToolCallError) and fragment in out.message, out


def test_random_bytes_never_crash_the_parser():
    rng = random.Random(0)
    alphabet = '<>/="tool name path run_tests write_file\n\x00\xff' + "".join(map(chr, range(32, 127)))
    tok = ByteTokenizer()
    for _ in range(3000):
        n = rng.randint(0, 80)
        text = "".join(rng.choice(alphabet) for _ in range(n))
        if rng.random() < 0.5:
            text = "<tool " + text
        out = parse(text)
        assert out is None or isinstance(out, (ToolCall, ToolCallError))
        ids = [rng.randrange(VOCAB_SIZE) for _ in range(n)]  # arbitrary model tokens, invalid UTF-8 included
        assert isinstance(parse(tok.decode(ids)), (type(None), ToolCall, ToolCallError))
    assert isinstance(parse_tool_call(None, TOOLS), ToolCallError)  # type: ignore[arg-type]


def test_patch_body():
    body = "<<<<<<< SEARCH\n    return a - b\n=======\n    return a + b\n>>>>>>> REPLACE"
    assert parse_patch(body) == ("    return a - b", "    return a + b")
    assert parse_patch("<<<<<<< SEARCH\nx\n=======\n>>>>>>> REPLACE") == ("x", "")
    for bad in ["", "x", "<<<<<<< SEARCH\n=======\ny\n>>>>>>> REPLACE", "<<<<<<< SEARCH\nx\n>>>>>>> REPLACE"]:
        assert isinstance(parse_patch(bad), ToolCallError)


def test_chat_template_layout_and_byte_round_trip():
    t = ChatTemplate()
    ids = t.prompt_ids([{"role": "user", "content": "héllo"}])
    assert ids[:2] == [BOS, USER] and ids[-2:] == [EOT, ASSISTANT]
    assert t.tok.decode(ids) == "héllo" and all(0 <= i < VOCAB_SIZE for i in ids)
    closed = t.observation_ids([10, 11, EOT], "out")
    assert closed[0] == TOOL and closed[-2:] == [EOT, ASSISTANT]
    assert t.observation_ids([10, 11], "out")[0] == EOT  # an open turn is closed by the env
    assert t.tok.render(ids).startswith("<|bos|><|user|>h")
    with pytest.raises(ValueError, match="unknown chat role"):
        t.message_ids("robot", "x")
