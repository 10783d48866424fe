"""The incremental parser of K3 XTML replies (the renderer is k3/text/xtml.py).

Events are ("reasoning", text), ("content", text), ("tool_call", i, call) with i the
call's index in `reply.tool_calls` (OpenAI's streaming index, dense), and
("tool_call_error", j, message) with j the 0-based position of the malformed call element in the
reply (the official index attribute minus one). Recovery: an element opened where it cannot be
(a `response` inside `think`, a `call` after an unclosed one) closes the open ones first; a close
tag closes everything inside it; a call outside `tools` opens `tools`; a reply cut short keeps
what was seen and reports an unclosed call as an error. A malformed call never raises.
"""
from __future__ import annotations

import codecs
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from k3.text.xtml_markup import ARGUMENT_TYPES, json_compact, unescape_attr

if TYPE_CHECKING:
    from k3.text.xtml import XTML


@dataclass
class Reply:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI shape, the well-formed calls
    errors: list[str] = field(default_factory=list)  # one line per malformed call or stray element
    complete: bool = False  # ended at end_of_msg / eos or closed its message (False: cut short)



_HEADER = re.compile(r'\s*([A-Za-z_][\w.-]*)((?:\s+[A-Za-z_][\w.-]*="[^"]*")*)\s*', re.DOTALL)
_ATTR = re.compile(r'([A-Za-z_][\w.-]*)="([^"]*)"')
_CHILDREN = {"message": ("think", "response", "tools"), "tools": ("call",), "call": ("argument", "json")}
_KNOWN = ("think", "response", "tools", "call", "argument", "json")
_TEXT_KIND = {"think": "reasoning", "response": "content"}


def _parse_header(text: str) -> tuple[str, dict[str, str] | None]:
    """(tag name, attributes), attributes None when the tag is malformed (or repeats one)."""
    m = _HEADER.fullmatch(text)
    if m is None:
        words = text.split(maxsplit=1)
        return (words[0] if words else ""), None
    attrs: dict[str, str] = {}
    for key, value in _ATTR.findall(m.group(2)):
        if key in attrs:
            return m.group(1), None
        attrs[key] = unescape_attr(value)
    return m.group(1), attrs


def _reject_constant(name: str):
    raise ValueError(name)  # NaN and Infinity are Python's, not JSON's


def _typed_value(raw: bytes, kind: str):
    """An argument's value from its text and declared type; ValueError says why it does not fit."""
    text = raw.decode("utf-8")  # UnicodeDecodeError is a ValueError
    if kind == "string":
        return text
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        raise ValueError(f"not a JSON {kind}") from None
    ok = {"number": isinstance(value, (int, float)) and not isinstance(value, bool)
          and (not isinstance(value, float) or math.isfinite(value)),
          "boolean": isinstance(value, bool), "null": value is None,
          "object": isinstance(value, dict), "array": isinstance(value, list)}[kind]
    if not ok:
        raise ValueError(f"not a JSON {kind}")
    return value


class TokenStreamParser:
    """What the reply parsers share (this one and k3/text/template_reply.py's): ids in as they come,
    the events each piece completes out. A subclass steps one id (`_step`), ends the reply (`_end`),
    hands out the pending events (`_take`) and sets `_mode` to "done" at the end."""

    _mode: str

    def feed(self, ids: Sequence[int]) -> list:
        for i in ids:
            if self._mode == "done":
                break  # a reply ends at its stop token
            self._step(int(i))
        return self._take()

    def finish(self) -> list:
        """The reply ended: at a stop token (already handled), or cut short (max tokens)."""
        if self._mode != "done":
            self._end(stopped=False)
        return self._take()


class _Frame:
    """An open element of the reply. A call frame holds the call being read; an argument or json
    frame collects its value's bytes."""
    __slots__ = ("args", "data", "error", "json", "key", "kind", "name", "pos", "tag")

    def __init__(self, tag: str):
        self.tag = tag
        self.error: str | None = None
        self.data = bytearray()
        self.args: dict = {}
        self.json = None
        self.name = self.key = self.kind = None
        self.pos = 0


class ReplyParser(TokenStreamParser):
    """Incremental parser of one assistant reply, over token ids. Feed it ids as they come; it
    returns the events each piece completes. See the module docstring for the events."""

    def __init__(self, xtml: XTML, *, opened: str = "think", tools: bool = True, forced_tool: str | None = None):
        if opened not in ("think", "response", "tools", "call"):
            raise ValueError(f"opened must be think, response, tools or call, got {opened!r}")
        if opened == "call" and not forced_tool:
            raise ValueError("a reply that starts inside a call needs its forced_tool")
        self._open, self._sep, self._close = xtml.open, xtml.sep, xtml.close
        self._stops = set(xtml.stop_ids)
        self._bytes = xtml.token_bytes
        self._tools = tools
        self._reply = Reply()
        self._text_parts: dict[str, list[str]] = {"content": [], "reasoning": []}
        self._events: list = []
        self._stack = [_Frame("message")]
        self._mode = "body"  # body | open | close (reading a tag header) | done
        self._header = bytearray()
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._loose: list[str] = []  # text outside any channel, judged at the next marker
        self._calls = 0  # call elements seen
        if opened in ("think", "response"):
            self._stack.append(_Frame(opened))
        else:
            self._stack.append(_Frame("tools"))
            if opened == "call":
                self._start_call({"tool": forced_tool, "index": "1"})

    # ---- input (feed, finish: TokenStreamParser)

    def _step(self, i: int) -> None:
        if i == self._sep and self._mode in ("open", "close"):
            header = bytes(self._header).decode("utf-8", "replace")
            mode, self._mode = self._mode, "body"
            if mode == "open":
                self._open_tag(header)
            else:
                self._close_tag(header)
        elif i in (self._open, self._close, self._sep):
            self._marker()
            if i != self._sep:  # a lone sep is noise
                self._mode = "open" if i == self._open else "close"
                self._header.clear()
        elif i in self._stops:
            self._end(stopped=True)
        elif self._mode in ("open", "close"):
            self._header += self._bytes[i] if i < len(self._bytes) else b""
        else:
            self._text(self._bytes[i] if i < len(self._bytes) else b"")

    def _text(self, data: bytes) -> None:
        if not self._stack:
            return  # after the message closed
        top = self._stack[-1]
        if top.tag in ("think", "response", "message"):
            text = self._decoder.decode(data)
            if text:
                self._route(top, text)
        elif top.tag in ("tools", "call", "argument", "json"):
            top.data += data

    def _route(self, top: _Frame, text: str) -> None:
        if top.tag == "message":
            self._loose.append(text)
        else:
            self._emit(_TEXT_KIND[top.tag], text)

    def _marker(self) -> None:
        """A marker ends the text run before it (and interrupts an unfinished tag)."""
        if self._mode in ("open", "close"):
            self._abandon_header()
        tail = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        if self._stack:
            top = self._stack[-1]
            if tail and top.tag in ("think", "response", "message"):
                self._route(top, tail)
            if top.tag in ("tools", "call") and top.data:
                if bytes(top.data).strip():
                    self._error(top, "text between its elements")
                top.data.clear()
        if self._loose:
            loose, self._loose = "".join(self._loose), []
            if loose.strip():  # a reply that skipped `<|open|>response<|sep|>`: keep its text as content
                self._emit("content", loose)

    def _end(self, stopped: bool) -> None:
        self._marker()
        while self._stack:
            self._pop(truncated=True)
        self._reply.complete = self._reply.complete or stopped
        self._mode = "done"

    # ---- structure

    def _open_tag(self, header: str) -> None:
        name, attrs = _parse_header(header)
        if not self._stack:
            return  # after the message closed
        if name == "call" and not any(f.tag in ("tools", "call", "argument", "json") for f in self._stack):
            self._pop_to(0)
            self._stack.append(_Frame("tools"))  # a call must be inside tools: open it
        at = next((j for j in range(len(self._stack) - 1, -1, -1)
                   if name in _CHILDREN.get(self._stack[j].tag, ())), None)
        if name not in _KNOWN or at is None:
            self._stack.append(_Frame("?" + name))  # swallowed up to its close
            if any(f.tag == "call" for f in self._stack):
                self._error(next(f for f in reversed(self._stack) if f.tag == "call"), f"unexpected <{name}> element")
            else:
                self._reply.errors.append(f"unexpected <{name}> element")
            return
        self._pop_to(at)
        if name == "call":
            self._start_call(attrs)
        elif name in ("argument", "json"):
            self._start_value(name, attrs)
        else:
            self._stack.append(_Frame(name))

    def _close_tag(self, header: str) -> None:
        name = header.strip()
        if name == "message":
            while self._stack:
                self._pop(truncated=False)
            self._reply.complete = True
            return
        at = next((j for j in range(len(self._stack) - 1, 0, -1) if self._stack[j].tag in (name, "?" + name)), None)
        if at is not None:
            self._pop_to(at - 1)  # a close tag closes what is still open inside it

    def _abandon_header(self) -> None:
        """A tag cut off by another marker or the reply's end."""
        name, attrs = _parse_header(bytes(self._header).decode("utf-8", "replace"))
        if self._mode == "open" and name == "call" and self._stack:
            frame = _Frame("call")
            frame.pos, self._calls = self._calls, self._calls + 1
            frame.name = (attrs or {}).get("tool")
            frame.error = "the call tag is unfinished"
            self._emit_call(frame)
        else:
            self._reply.errors.append(f"unfinished <{'/' if self._mode == 'close' else ''}{name}> tag")
        self._mode = "body"
        self._header.clear()

    def _pop_to(self, depth: int) -> None:
        while len(self._stack) > depth + 1:
            self._pop(truncated=False)

    def _pop(self, truncated: bool) -> None:
        frame = self._stack.pop()
        if frame.tag in ("argument", "json"):
            call = self._stack[-1]
            if truncated or call.error is not None:
                return
            try:
                if frame.tag == "json":
                    value = _typed_value(bytes(frame.data), "object")
                    if call.args:
                        raise ValueError("mixes a json block with typed arguments")
                    call.json = value
                else:
                    call.args[frame.key] = _typed_value(bytes(frame.data), frame.kind)
            except ValueError as e:
                what = "json block" if frame.tag == "json" else f"argument {frame.key!r}"
                self._error(call, f"{what}: {e}".splitlines()[0])
        elif frame.tag == "call":
            if truncated and frame.error is None:
                frame.error = "the reply ended inside the call"
            self._emit_call(frame)

    def _start_call(self, attrs: dict[str, str] | None) -> None:
        frame = _Frame("call")
        frame.pos, self._calls = self._calls, self._calls + 1
        self._stack.append(frame)
        if attrs is None:
            return self._error(frame, "malformed call tag")
        frame.name = attrs.get("tool")
        if set(attrs) != {"tool", "index"}:
            return self._error(frame, f"call attributes must be tool and index, got {sorted(attrs)}")
        if not frame.name:
            return self._error(frame, "empty tool name")
        if attrs["index"] != str(frame.pos + 1):
            return self._error(frame, f"index {attrs['index']!r}, expected {frame.pos + 1}")
        if not self._tools:
            return self._error(frame, "the request offered no tools")

    def _start_value(self, tag: str, attrs: dict[str, str] | None) -> None:
        call = self._stack[-1]
        frame = _Frame(tag)
        self._stack.append(frame)
        if tag == "json":
            if attrs != {"type": "object"}:
                self._error(call, 'json block attributes must be type="object"')
            elif call.json is not None:
                self._error(call, "two json blocks")
            elif call.args:
                self._error(call, "mixes a json block with typed arguments")
            return
        if attrs is None or set(attrs) != {"key", "type"}:
            return self._error(call, "argument attributes must be key and type")
        frame.key, frame.kind = attrs["key"], attrs["type"]
        if frame.kind not in ARGUMENT_TYPES:
            return self._error(call, f"argument {frame.key!r}: unknown type {frame.kind!r}")
        if frame.key in call.args or call.json is not None:
            return self._error(call, f"argument {frame.key!r} given twice" if frame.key in call.args
                               else "mixes a json block with typed arguments")

    def _error(self, frame: _Frame, message: str) -> None:
        if frame.tag == "call":
            frame.error = frame.error or message
        else:
            self._reply.errors.append(f"<{frame.tag}>: {message}")

    # ---- output

    @property
    def reply(self) -> Reply:
        """The reply so far (its text is joined here, not per token: a long reply stays linear)."""
        for kind, parts in self._text_parts.items():
            if len(parts) > 1:
                parts[:] = ["".join(parts)]
            setattr(self._reply, kind, parts[0] if parts else "")
        return self._reply

    def _emit(self, kind: str, text: str) -> None:
        self._text_parts[kind].append(text)
        self._events.append((kind, text))

    def _emit_call(self, frame: _Frame) -> None:
        if frame.error is not None:
            message = f"call {frame.pos + 1} ({frame.name or '?'}): {frame.error}"
            self._reply.errors.append(message)
            self._events.append(("tool_call_error", frame.pos, message))
            return
        # deterministic ids (Kimi's `functions.NAME:N` convention): the same reply, streamed or not, gives the same ids
        call = {"id": f"functions.{frame.name}:{frame.pos + 1}", "type": "function",
                "function": {"name": frame.name, "arguments": json_compact(frame.json if frame.json is not None
                                                                             else frame.args)}}
        self._events.append(("tool_call", len(self._reply.tool_calls), call))
        self._reply.tool_calls.append(call)

    def _take(self) -> list:
        """This step's events, consecutive text of one kind joined."""
        out: list = []
        for e in self._events:
            if out and len(e) == 2 and len(out[-1]) == 2 and out[-1][0] == e[0]:
                out[-1] = (e[0], out[-1][1] + e[1])
            else:
                out.append(e)
        self._events = []
        return out
