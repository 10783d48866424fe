"""Reading and checking SFT data: a JSONL of OpenAI-style conversations, one per line.

A line is {"messages": [...], "tools": [...] (optional), "reasoning_effort": "low" (optional: the
effort message it is rendered with, OpenAI's values as in a chat request; default max), "expected":
{...} (optional, the default set's scoring record)}. Messages have a `role` in ROLES; assistant messages may carry
`reasoning_content` (or `reasoning`), `content` and `tool_calls` ({"id", "type": "function",
"function": {"name", "arguments": a JSON object, as a string or already parsed}}); tool messages name
a call of the assistant message before them with `tool_call_id`.

Everything is checked before anything is trained or written, and the first bad line stops the read
with an SFTDataError whose one-line message is "{path}:{line}: {what}" (the CLI prints it and exits 2).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from k3.data.jsonl import jsonl_records, strict_loads
from k3.text.tool_schema import compile_parameters
from k3.text.xtml import REASONING_EFFORT

ROLES = ("system", "developer", "user", "assistant", "tool")


class SFTDataError(ValueError):
    """Unusable SFT data; the one-line message names the file and line."""


@dataclass
class Conversation:
    messages: list[dict]
    tools: list[dict] | None
    line: int  # 1-based line of the JSONL file (the position, for the default set)
    source: str = ""  # the file's path, or a name for generated data; errors say "{source}:{line}"
    expected: dict | None = None
    reasoning_effort: str | None = None  # OpenAI's value; None: the default effort (max)

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"


class _Bad(Exception):
    """What is wrong with one line; read_conversations adds the path and line."""


def _short(value, limit: int = 40) -> str:
    text = repr(value)  # repr escapes newlines, so the message stays on one line
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _check_content(i: int, content) -> None:
    if content is None or isinstance(content, str):
        return
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return
    raise _Bad(f"message {i}: content must be a string, null or a list of text parts")


def _check_tools(tools) -> set[str] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _Bad("'tools' must be a list")
    names: set[str] = set()
    for j, tool in enumerate(tools, 1):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise _Bad(f"tool {j} is not {{\"type\": \"function\", \"function\": {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise _Bad(f"tool {j} has no function name")
        if name in names:
            raise _Bad(f"tool {j}: {name!r} is declared twice")
        params = fn.get("parameters")
        if params is not None:
            try:
                compile_parameters(params)
            except ValueError as e:
                raise _Bad(f"tool {j} ({name}): {e}") from None
        names.add(name)
    return names


def _check_call(i: int, k: int, call, declared: set[str] | None) -> str:
    """One assistant tool call; returns its id."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        raise _Bad(f"message {i}: tool call {k} has no 'function' object")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise _Bad(f"message {i}: tool call {k} has no function name")
    if declared is not None and name not in declared:
        raise _Bad(f"message {i}: tool call {k} names {name!r}, which is not among the declared tools "
                   f"({', '.join(sorted(declared)) or 'none'})")
    call_id = call.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise _Bad(f"message {i}: tool call {k} ({name}) has no id")
    args = fn.get("arguments")
    if args is None:
        raise _Bad(f"message {i}: tool call {k} ({name}) has no arguments")
    if isinstance(args, str):
        try:
            args = strict_loads(args)
        except json.JSONDecodeError as e:
            raise _Bad(f"message {i}: tool call {k} ({name}): arguments are not valid JSON "
                       f"({e.msg} at column {e.colno})") from None
        except ValueError as e:
            raise _Bad(f"message {i}: tool call {k} ({name}): arguments are not valid JSON ({e})") from None
    if not isinstance(args, dict):
        raise _Bad(f"message {i}: tool call {k} ({name}): arguments must be a JSON object")
    return call_id


def _check_messages(messages, declared: set[str] | None) -> None:
    if not isinstance(messages, list) or not messages:
        raise _Bad("needs a non-empty 'messages' list")
    call_ids: set[str] = set()  # the calls of the latest assistant message: what a tool result may answer
    assistant = False
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict):
            raise _Bad(f"message {i} is not an object")
        if "role" not in m:
            raise _Bad(f"message {i} has no role")
        role = m["role"]
        if role not in ROLES:
            raise _Bad(f"message {i} has unknown role {_short(role)} (expected one of {', '.join(ROLES)})")
        _check_content(i, m.get("content"))
        if role != "assistant" and m.get("content") is None:
            raise _Bad(f"message {i} ({role}) has no content")
        if role == "assistant":
            assistant = True
            for key in ("reasoning_content", "reasoning"):
                if not isinstance(m.get(key), (str, type(None))):
                    raise _Bad(f"message {i}: {key} must be a string")
            calls = m.get("tool_calls")
            if calls is not None and not isinstance(calls, list):
                raise _Bad(f"message {i}: tool_calls must be a list")
            call_ids = {_check_call(i, k, call, declared) for k, call in enumerate(calls or (), 1)}
        elif role == "tool":
            ref = m.get("tool_call_id")
            if not isinstance(ref, str) or not ref:
                raise _Bad(f"message {i} (tool) has no tool_call_id")
            if ref not in call_ids:
                raise _Bad(f"message {i}: tool result names unknown call id {_short(ref)} "
                           f"(no call of the assistant message before it has that id)")
    if not assistant:
        raise _Bad("no assistant message (nothing to learn)")


def parse_conversation(record, line: int = 1, source: str = "") -> Conversation:
    """One decoded JSONL record, checked; raises SFTDataError naming `source:line`."""
    try:
        if not isinstance(record, dict):
            raise _Bad(f"each line must be a JSON object, got {type(record).__name__}")
        if "messages" not in record:
            raise _Bad("no 'messages' list")
        declared = _check_tools(record.get("tools"))
        _check_messages(record["messages"], declared)
        expected = record.get("expected")
        if expected is not None and not isinstance(expected, dict):
            raise _Bad("'expected' must be an object")
        effort = record.get("reasoning_effort")
        if effort is not None and effort not in REASONING_EFFORT:
            raise _Bad(f"'reasoning_effort' must be one of {list(REASONING_EFFORT)}, got {effort!r}")
    except _Bad as e:
        raise SFTDataError(f"{source}:{line}: {e}") from None
    return Conversation(record["messages"], record.get("tools"), line, source, expected, effort)


def read_conversations(path: str | Path) -> list[Conversation]:
    """Every conversation of a JSONL file (blank lines skipped), or SFTDataError at the first bad line."""
    label = str(path)
    convs = []
    line = 0
    try:
        for line, record in jsonl_records(path, SFTDataError, label):
            convs.append(parse_conversation(record, line, label))
    except OSError as e:
        where = f"{label}:{line}" if line else label  # line 0: the file could not be opened
        raise SFTDataError(f"{where}: cannot read ({e.strerror or e})") from None
    if not convs:
        raise SFTDataError(f"{label}:{max(line, 1)}: no conversations (the file is empty)")
    return convs


def check_length(conv: Conversation, n_tokens: int, max_tokens: int) -> None:
    """Called by the trainer once the conversation is rendered: a conversation must fit one sequence."""
    if n_tokens > max_tokens:
        raise SFTDataError(f"{conv.where}: conversation is {n_tokens} tokens, over the limit {max_tokens} (--seq-len)")
