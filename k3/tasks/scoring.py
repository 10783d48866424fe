"""Scoring a model on held-out SFT conversations: is the reply well-formed, is the tool right, are the
arguments right, is the answer right.

A conversation's `expected` (written by k3/tasks/default_set.py) is {"tool": name or None, "arguments":
{...} or None, "answer": str}. `ConversationTask` is such a conversation as an episode of the one
runner (k3/tasks/episodes.py): the prompt up to the first assistant turn, the model's first reply,
the model's own tool call run with `call_tool`, and its final reply. Replies are whatever the chat
renderer's parser returns; only the `Reply` protocol's attributes are read.
"""
from __future__ import annotations

import json
import re
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


class ConversationTask:
    """A held-out conversation (a default-set dict or a dataset Conversation with `expected`) as an
    episode task (k3/tasks/episodes.py): its prompt up to the first assistant message, a reply, and
    after a tool call the model's own call run with `call_tool` and the final reply; scored by `score`."""
    max_turns = 2  # the call, then the answer after its result

    def __init__(self, conv):
        self.expected = _field(conv, "expected")
        if not self.expected:
            raise ValueError("the conversation has no 'expected' record to score against")
        self.conversation = conv
        self.tools = _field(conv, "tools")
        messages = _field(conv, "messages")
        cut = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
        self.messages = [dict(m) for m in messages[:cut]]
        self.line = _field(conv, "line")
        self.id = f"conversation/{_field(conv, 'source') or ''}:{self.line}"

    def render(self, xtml, messages: list[dict] | None = None, effort: str | None = None):
        return xtml.render(self.messages if messages is None else messages, tools=self.tools, reasoning_effort=effort)

    def tool_results(self, history: list[dict], calls: list[dict]) -> list[str]:
        return [call_tool((c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments"))
                for c in calls]

    def verify(self, replies) -> dict[str, bool]:
        return score(self.expected, replies[0], replies[1] if len(replies) > 1 else None, self.tools)


def summarize_episodes(episodes, tokenizer) -> tuple[dict, list[dict]]:
    """The summary of ConversationTask episodes (k3/tasks/episodes.py) and one record per episode:
    its scores and the decoded first and final replies."""
    scores = [e.score for e in episodes]
    records = [{"line": e.task.line, **e.score, "reply": tokenizer.decode(e.turns[0], skip_special_tokens=False),
                "final": tokenizer.decode(e.turns[1], skip_special_tokens=False) if len(e.turns) > 1 else None}
               for e in episodes]
    summary = summarize(scores)
    # the agent-loop bars read over the prompts that need a tool: right tool with valid arguments, answer after it
    tool = [e.score for e in episodes if e.task.expected.get("tool") is not None]
    if tool:
        summary["tool_prompts_tool_ok"] = sum(sc["tool_ok"] for sc in tool) / len(tool)
        summary["tool_prompts_answer_correct"] = sum(sc["answer_correct"] for sc in tool) / len(tool)
    return summary, records
