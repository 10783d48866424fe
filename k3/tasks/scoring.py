"""Scoring a model on held-out SFT conversations: is the reply well-formed, is the tool right, are the
arguments right, is the answer right.

A conversation's `expected` (written by k3/tasks/default_set.py) is {"tool": name or None, "arguments":
{...} or None, "answer": str}. `agent_episode` plays one conversation against a model: the prompt up
to the first assistant turn, the model's first reply, the model's own tool call run with `call_tool`,
and its final reply. Replies are whatever the chat renderer's parser returns; only the `Reply`
protocol's attributes are read, so this module does not depend on the renderer.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Protocol

from k3.tasks.tools import TOOLS, call_tool
from k3.text.tool_schema import compile_parameters

METRICS = ("valid_xtml", "right_tool", "valid_arguments", "tool_ok", "answer_correct")


class Reply(Protocol):
    content: str
    reasoning: str
    tool_calls: list[dict]  # OpenAI shape: {"id", "type": "function", "function": {"name", "arguments": str}}
    errors: list[str]  # what the parser could not make sense of; empty for a well-formed reply
    complete: bool  # the reply ended properly (not cut off by the token limit)


ReplyFn = Callable[[list[dict], list[dict] | None], Reply]


def _same(got, want) -> bool:
    """JSON equality with numbers compared by value (3 == 3.0), booleans only equal to booleans."""
    num = (int, float)
    if isinstance(want, num) and not isinstance(want, bool):
        return isinstance(got, num) and not isinstance(got, bool) and got == want
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(_same, got, want))
    return type(got) is type(want) and got == want


def _arguments(call: dict) -> dict | None:
    """A call's arguments as a dict, or None when they are not a JSON object."""
    args = (call.get("function") or {}).get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return args if isinstance(args, dict) else None


def _schema(name, tools: list[dict] | None) -> dict | None:
    for t in tools or TOOLS:
        if t.get("function", {}).get("name") == name:
            return t["function"].get("parameters") or {}
    return None


def _valid(schema: dict, args) -> bool:
    try:
        return compile_parameters(schema).is_valid(args)
    except ValueError:  # a schema of the caller's that does not compile validates nothing
        return False


def contains_answer(text: str, answer: str) -> bool:
    """`answer` occurs in `text` as a whole: "84" is not found in "184", "-84" or "84.5"."""
    return re.search(r"(?<![\w.\-])" + re.escape(answer.strip()) + r"(?!\w|\.\d)", text or "") is not None


def score(expected: dict, first: Reply, final: Reply | None, tools: list[dict] | None = None) -> dict[str, bool]:
    """Scores one episode. `tools`: the declarations the arguments are checked against (default: the
    default set's TOOLS). For a plain answer (expected tool None) the first reply must not call a
    tool and its content holds the answer; otherwise the final reply's content does."""
    replies = [first] + ([final] if final is not None else [])
    valid_xtml = all(not r.errors and r.complete for r in replies)
    calls = list(first.tool_calls or ())
    want_tool = expected.get("tool")
    if want_tool is None:
        right_tool = valid_arguments = not calls
        answer_text = first.content
    else:
        names = [(c.get("function") or {}).get("name") for c in calls]
        right_tool = bool(names) and all(n == want_tool for n in names)
        args = _arguments(calls[0]) if calls else None
        schema = _schema(names[0], tools) if calls else None
        valid_arguments = (args is not None and schema is not None and _valid(schema, args)
                           and _same(args, expected.get("arguments") or {}))
        answer_text = final.content if final is not None else None
    answer = expected.get("answer")
    answer_correct = answer_text is not None and (answer is None or contains_answer(answer_text, answer))
    return {"valid_xtml": valid_xtml, "right_tool": right_tool, "valid_arguments": valid_arguments,
            "tool_ok": right_tool and valid_arguments, "answer_correct": answer_correct}


def summarize(scores: list[dict[str, bool]]) -> dict[str, float | int]:
    """The share of episodes passing each metric, and their number as "n"."""
    n = len(scores)
    out = {m: (sum(bool(s[m]) for s in scores) / n if n else 0.0) for m in METRICS}
    out["n"] = n  # an int, so rate tables (floats) leave it out
    return out


def _field(conv, name: str):
    return conv.get(name) if isinstance(conv, dict) else getattr(conv, name, None)


def agent_episode(conv, reply_fn: ReplyFn) -> dict[str, bool]:
    """Play one conversation (a default-set dict or a dataset Conversation with `expected`):
    `reply_fn(messages, tools) -> Reply` answers the prompt; a tool call is run with `call_tool` on
    the model's own arguments, its result appended, and `reply_fn` asked again for the final answer."""
    expected = _field(conv, "expected")
    if not expected:
        raise ValueError("the conversation has no 'expected' record to score against")
    tools = _field(conv, "tools")
    all_messages = _field(conv, "messages")
    cut = next((i for i, m in enumerate(all_messages) if m.get("role") == "assistant"), len(all_messages))
    messages = [dict(m) for m in all_messages[:cut]]
    first = reply_fn(list(messages), tools)
    final = None
    if first.tool_calls:
        turn = {"role": "assistant", "content": first.content or None, "tool_calls": list(first.tool_calls)}
        if first.reasoning:
            turn["reasoning_content"] = first.reasoning
        messages.append(turn)
        for k, call in enumerate(first.tool_calls, 1):
            fn = call.get("function") or {}
            result = call_tool(fn.get("name"), fn.get("arguments"))
            messages.append({"role": "tool", "tool_call_id": call.get("id") or f"call_{k}", "content": result})
        final = reply_fn(list(messages), tools)
    return score(expected, first, final, tools)
