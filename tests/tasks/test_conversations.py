"""Reading SFT data: good files load; each kind of bad line is a one-line SFTDataError naming the line."""
from __future__ import annotations

import json

import pytest

from k3.tasks.conversations import Conversation, SFTDataError, check_length, read_conversations
from k3.tasks.tools import TOOLS

CALL = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2 + 3"}'}}
GOOD = {"messages": [{"role": "user", "content": "What is 2 + 3?"},
                     {"role": "assistant", "reasoning_content": "Use it.", "content": None, "tool_calls": [CALL]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "5"},
                     {"role": "assistant", "content": "The answer is 5."}],
        "tools": TOOLS}


def _write(tmp_path, lines: list) -> str:
    path = tmp_path / "sft.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def _with(**changes) -> dict:
    record = json.loads(json.dumps(GOOD))
    record.update(changes)
    return record


def _message(i: int, **changes) -> dict:
    record = _with()
    record["messages"][i].update(changes)
    return record


def _call(**fn_changes) -> dict:
    record = _with()
    record["messages"][1]["tool_calls"][0]["function"].update(fn_changes)
    return record


def test_reads_good_data(tmp_path):
    plain = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "text", "text": "Hi"}]}, {"role": "assistant", "content": "Hello."}]}
    no_tools = _with()
    del no_tools["tools"]
    no_tools["messages"][1]["tool_calls"][0]["function"] = {"name": "anything", "arguments": {"a": 1}}
    path = _write(tmp_path, [GOOD, "", plain, "   ", no_tools])
    convs = read_conversations(path)
    assert [c.line for c in convs] == [1, 3, 5]
    assert convs[0].messages == GOOD["messages"] and convs[0].tools == TOOLS and convs[0].expected is None
    assert convs[1].tools is None and convs[1].source == path
    assert convs[0].reasoning_effort is None
    assert read_conversations(_write(tmp_path, [_with(reasoning_effort="low")]))[0].reasoning_effort == "low"


BAD = [
    ("not json", "{nope", "not valid JSON"),
    ("not an object", [1, 2], "must be a JSON object"),
    ("no messages", {"tools": []}, "no 'messages' list"),
    ("messages not a list", {"messages": "hi"}, "non-empty 'messages' list"),
    ("empty messages", {"messages": []}, "non-empty 'messages' list"),
    ("message not an object", _with(messages=["hi"]), "message 1 is not an object"),
    ("no role", _with(messages=[{"content": "hi"}]), "message 1 has no role"),
    ("unknown role", _message(0, role="robot"), "unknown role 'robot'"),
    ("bad content", _message(0, content=5), "content must be"),
    ("user without content", _message(0, content=None), "has no content"),
    ("no function name", _call(name=""), "tool call 1 has no function name"),
    ("no function", _with(messages=[GOOD["messages"][0], {"role": "assistant", "tool_calls": [{"id": "c"}]}]),
     "has no 'function' object"),
    ("invalid JSON arguments", _call(arguments='{"expression": '), "arguments are not valid JSON"),
    ("arguments not an object", _call(arguments="[1]"), "arguments must be a JSON object"),
    ("NaN in arguments", _call(arguments='{"expression": NaN}'), "NaN is not a JSON number"),
    ("number beyond a double", _call(arguments='{"expression": 1e999}'), "1e999 overflows a double"),
    ("missing arguments", _call(arguments=None), "has no arguments"),
    ("undeclared tool", _call(name="weather"), "'weather', which is not among the declared tools"),
    ("unknown call id", _message(2, tool_call_id="call_9"), "unknown call id 'call_9'"),
    ("tool result before its call", _with(messages=[GOOD["messages"][0], GOOD["messages"][2], GOOD["messages"][1]]),
     "unknown call id 'call_1'"),
    ("result of an older turn's call", _with(messages=GOOD["messages"] + [
        {"role": "user", "content": "And again?"}, {"role": "assistant", "content": "", "tool_calls": [
            dict(CALL, id="call_2")]}, {"role": "tool", "tool_call_id": "call_1", "content": "5"}]),
     "unknown call id 'call_1'"),
    ("no tool_call_id", _message(2, tool_call_id=None), "has no tool_call_id"),
    ("no assistant", _with(messages=[GOOD["messages"][0]]), "no assistant message"),
    ("tools not a list", _with(tools={"a": 1}), "'tools' must be a list"),
    ("bad tool schema", _with(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]),
     "not a valid JSON Schema"),
    ("schema reading a file", _with(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"$ref": "file:///etc/hostname"}}}]), "external $ref 'file:///etc/hostname'"),
    ("expected not an object", _with(expected=[1]), "'expected' must be an object"),
    ("unknown effort", _with(reasoning_effort="huge"), "'reasoning_effort' must be one of"),
]


@pytest.mark.parametrize("record,what", [(r, w) for _, r, w in BAD], ids=[i for i, _, _ in BAD])
def test_bad_line_names_the_line(tmp_path, record, what):
    path = _write(tmp_path, [GOOD, "", record, "{also bad"])
    with pytest.raises(SFTDataError) as e:
        read_conversations(path)
    message = str(e.value)
    assert message.startswith(f"{path}:3: "), message  # the first bad line, counting blank lines
    assert what in message
    assert "\n" not in message and "Traceback" not in message


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(SFTDataError, match=r"empty\.jsonl:\d+: no conversations"):
        read_conversations(path)


def test_not_utf8_and_missing_file(tmp_path):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe\n")
    with pytest.raises(SFTDataError, match=r"bin\.jsonl:2: not UTF-8"):
        read_conversations(path)
    with pytest.raises(SFTDataError, match="cannot read") as e:
        read_conversations(tmp_path / "missing.jsonl")
    assert "\n" not in str(e.value)


def test_check_length():
    conv = Conversation(GOOD["messages"], TOOLS, line=7, source="data.jsonl")
    check_length(conv, 256, 256)
    with pytest.raises(SFTDataError) as e:
        check_length(conv, 300, 256)
    assert str(e.value) == "data.jsonl:7: conversation is 300 tokens, over the limit 256 (--seq-len)"
