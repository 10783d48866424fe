"""K3's chat format: messages <-> token ids, and the model's reply -> content / reasoning / tool calls.

Each message is `<|open|>role<|sep|>content<|close|>`, the three markers being the training
tokenizer's reserved special tokens (k3/text/tokenizer.py). Markers are inserted as ids, never
parsed from text (the tokenizer encodes a literal "<|open|>" in user text as plain text), so a
user cannot forge a turn. The prompt ends with `<|open|>assistant<|sep|>`; the reply ends with
`<|close|>`.

Inside an assistant turn, plain-text tags (simple for now, and round-tripping exactly):
    <think>reasoning</think>content<tool_call>{"id": ..., "name": ..., "arguments": {...}}</tool_call>
Tool definitions go in a `tools` turn after the system prompt, tool results in `tool` turns
(JSON with the call id). `reasoning_effort` becomes a `system` turn FIRST, so that the whole
conversation stays a stable prefix across turns (the prefix cache relies on that).
The start of every turn is reported as a boundary: the engine may checkpoint KDA state there.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from k3.text.partial_match import held_back
from k3.text.tokenizer import encode_text, special_ids

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
ROLES = ("system", "developer", "user", "assistant", "tool")

# OpenAI's values of reasoning_effort onto K3's three levels (documented in docs/SERVING.md).
REASONING_EFFORT = {"none": "low", "minimal": "low", "low": "low", "medium": "high", "high": "high",
                    "xhigh": "max", "max": "max"}


def map_reasoning_effort(value: str | None) -> str | None:
    if value is None:
        return None
    if value not in REASONING_EFFORT:
        raise ValueError(f"reasoning_effort must be one of {sorted(REASONING_EFFORT)}, got {value!r}")
    return REASONING_EFFORT[value]


@dataclass
class RenderedPrompt:
    token_ids: list[int]
    boundaries: tuple[int, ...]  # token index where each turn starts


def _text(content) -> str:
    """A message's content: a string, None, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise ValueError(f"only text content parts are supported, got {part.get('type')!r}")
        parts.append(part["text"])
    return "".join(parts)


def render_tool_call(call: dict) -> str:
    fn = call["function"]
    try:
        args = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) else fn["arguments"]
    except json.JSONDecodeError as e:
        raise ValueError(f"tool call {fn.get('name')!r}: arguments are not valid JSON ({e})") from None
    return TOOL_OPEN + json.dumps({"id": call.get("id"), "name": fn["name"], "arguments": args}) + TOOL_CLOSE


class ChatFormat:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        ids = special_ids(tokenizer)
        self.open, self.sep, self.close, self.eos = ids["open"], ids["sep"], ids["close"], ids["eos"]

    def _turn(self, role: str, text: str, close: bool = True) -> list[int]:
        ids = [self.open] + self.tokenizer.encode(role, add_special_tokens=False).ids + [self.sep]
        ids += encode_text(self.tokenizer, text) if text else []
        return ids + [self.close] if close else ids

    def message_text(self, message: dict) -> tuple[str, str]:
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"message role must be one of {ROLES}, got {role!r}")
        if role == "developer":
            role = "system"
        text = _text(message.get("content"))
        if role == "assistant":
            reasoning = message.get("reasoning") or message.get("reasoning_content")
            if reasoning:
                text = THINK_OPEN + reasoning + THINK_CLOSE + text
            text += "".join(render_tool_call(c) for c in message.get("tool_calls") or ())
        elif role == "tool":
            text = json.dumps({"tool_call_id": message.get("tool_call_id"), "content": text})
        return role, text

    def render(self, messages: list[dict], *, tools: list[dict] | None = None, reasoning_effort: str | None = None,
               add_generation_prompt: bool = True) -> RenderedPrompt:
        if not messages:
            raise ValueError("messages must not be empty")
        turns: list[tuple[str, str]] = []
        effort = map_reasoning_effort(reasoning_effort)
        if effort is not None:
            turns.append(("system", f"reasoning effort: {effort}"))
        rendered = [self.message_text(m) for m in messages]
        n_system = 0
        while n_system < len(rendered) and rendered[n_system][0] == "system":
            n_system += 1
        turns += rendered[:n_system]
        if tools:
            turns.append(("tools", json.dumps(tools)))
        turns += rendered[n_system:]
        ids: list[int] = []
        boundaries = []
        for role, text in turns:
            boundaries.append(len(ids))
            ids += self._turn(role, text)
        if add_generation_prompt:
            boundaries.append(len(ids))
            ids += self._turn("assistant", "", close=False)
        return RenderedPrompt(ids, tuple(b for b in boundaries if b > 0))

    def parse(self, text: str, tools: bool = True) -> "Reply":
        parser = ReplyParser(tools)
        parser.feed(text)
        parser.finish()
        return parser.reply


@dataclass
class Reply:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI shape


class ReplyParser:
    """Splits a reply, possibly arriving in pieces, into reasoning / content / tool-call events.
    Text that might be the start of a tag is held back until it is known not to be one."""

    def __init__(self, tools: bool = True):
        self.tools = tools  # False: tool-call tags are plain text (the request offered no tools)
        self.state = "content"  # "content" | "think" | "tool"
        self._buf = ""
        self.reply = Reply()
        self.events: list[tuple[str, object]] = []  # ("content"|"reasoning", str) or ("tool_call", dict)

    def _emit(self, kind: str, value) -> None:
        if kind == "tool_call":
            self.reply.tool_calls.append(value)
        elif value:
            setattr(self.reply, kind, getattr(self.reply, kind) + value)
        else:
            return
        self.events.append((kind, value))

    def feed(self, text: str) -> list[tuple[str, object]]:
        """Consume more text; returns the events it completed."""
        start = len(self.events)
        self._buf += text
        while True:
            if self.state == "tool":
                end = self._buf.find(TOOL_CLOSE)
                if end < 0:
                    break
                body, self._buf = self._buf[:end], self._buf[end + len(TOOL_CLOSE):]
                self._tool_call(body)
                self.state = "content"
                continue
            kind = "reasoning" if self.state == "think" else "content"
            tags = [THINK_CLOSE] if self.state == "think" else [THINK_OPEN] + ([TOOL_OPEN] if self.tools else [])
            hits = [(self._buf.find(t), t) for t in tags if self._buf.find(t) >= 0]
            if hits:
                at, tag = min(hits)
                self._emit(kind, self._buf[:at])
                self._buf = self._buf[at + len(tag):]
                self.state = {THINK_OPEN: "think", THINK_CLOSE: "content", TOOL_OPEN: "tool"}[tag]
                continue
            hold = max(held_back(self._buf, t) for t in tags)
            self._emit(kind, self._buf[:len(self._buf) - hold])
            self._buf = self._buf[len(self._buf) - hold:]
            break
        return self.events[start:]

    def finish(self) -> list[tuple[str, object]]:
        """The reply ended: release held text (an unterminated tool call stays plain content)."""
        start = len(self.events)
        if self.state == "tool":
            self._emit("content", TOOL_OPEN + self._buf)
        else:
            self._emit("reasoning" if self.state == "think" else "content", self._buf)
        self._buf = ""
        return self.events[start:]

    def _tool_call(self, body: str) -> None:
        try:
            call = json.loads(body)
            name, args = call["name"], call.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError("name")
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            self._emit("content", TOOL_OPEN + body + TOOL_CLOSE)  # not a well-formed call: plain text
            return
        self._emit("tool_call", {"id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                 "function": {"name": name,
                                              "arguments": args if isinstance(args, str) else json.dumps(args)}})
