"""The incremental parser of replies in a folder's own chat format (k3/text/template_chat.py): the
text is the content, and where the template declares tools, Kimi's tool-call markers carry calls:
    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
    {JSON object}<|tool_call_end|>...<|tool_calls_section_end|>
as Kimi-Linear-Instruct (and K2) emit them. Markers are matched by id, never found in text. The
events are XTML's (k3/text/xtml_parser.py): ("content", text), ("tool_call", i, call) and
("tool_call_error", j, message); a malformed call never raises.
"""
from __future__ import annotations

import codecs
import json
from collections.abc import Sequence
from dataclasses import dataclass

from k3.text.xtml_markup import json_compact
from k3.text.xtml_parser import Reply, TokenStreamParser

TOOL_MARKERS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>")


@dataclass(frozen=True)
class ToolMarkerIds:
    section_begin: int
    section_end: int
    call_begin: int
    argument_begin: int
    call_end: int


def tool_marker_ids(tokenizer, template: str) -> ToolMarkerIds | None:
    """The ids of Kimi's tool-call markers when the template writes them and the tokenizer has them."""
    ids = [tokenizer.token_to_id(m) for m in TOOL_MARKERS]
    if None in ids or not all(m in template for m in TOOL_MARKERS[:2]):
        return None
    return ToolMarkerIds(*ids)


def _call_name(header: str) -> str:
    """NAME of the call id `functions.NAME:IDX` (the prefix and the index are optional)."""
    name = header.strip()
    name = name.removeprefix("functions.")
    head, sep, tail = name.rpartition(":")
    return head if sep and tail.isdigit() else name


class TemplateReplyParser(TokenStreamParser):
    """Feed it reply ids as they come; it returns the events each piece completes."""

    def __init__(self, token_bytes: list[bytes], stop_ids: Sequence[int], markers: ToolMarkerIds | None,
                 tools: bool):
        self._bytes, self._stops, self._markers, self._tools = token_bytes, set(stop_ids), markers, tools
        self._reply = Reply()
        self._content: list[str] = []
        self._events: list = []
        self._mode = "content"  # content | section | header | arguments | done
        self._header, self._args = bytearray(), bytearray()
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._calls = 0

    @property
    def reply(self) -> Reply:
        self._reply.content = "".join(self._content)
        return self._reply

    def _step(self, i: int) -> None:
        m = self._markers
        if i in self._stops:
            self._end(stopped=True)
        elif m is not None and i == m.section_begin:
            self._flush_text()
            self._mode = "section"
        elif m is not None and i == m.call_begin:
            self._flush_text()
            if self._mode in ("header", "arguments"):
                self._call_done(truncated=True)
            self._mode, self._header, self._args = "header", bytearray(), bytearray()
        elif m is not None and i == m.argument_begin and self._mode == "header":
            self._mode = "arguments"
        elif m is not None and i == m.call_end and self._mode in ("header", "arguments"):
            self._call_done(truncated=False)
            self._mode = "section"
        elif m is not None and i == m.section_end:
            if self._mode in ("header", "arguments"):
                self._call_done(truncated=True)
            self._mode = "content"
        else:
            data = self._bytes[i] if i < len(self._bytes) else b""
            if self._mode == "header":
                self._header += data
            elif self._mode == "arguments":
                self._args += data
            elif self._mode == "content":
                self._emit(self._decoder.decode(data))
            # text between calls inside a section is noise

    def _flush_text(self) -> None:
        self._emit(self._decoder.decode(b"", final=True))
        self._decoder.reset()

    def _emit(self, text: str) -> None:
        if text:
            self._content.append(text)
            self._events.append(("content", text))

    def _call_done(self, truncated: bool) -> None:
        pos = self._calls
        self._calls += 1
        header = bytes(self._header).decode("utf-8", "replace").strip()
        name = _call_name(header)
        error = None
        if truncated:
            error = "the call was not closed"
        elif not self._tools:
            error = "the request offered no tools"
        elif not name:
            error = "no function name"
        else:
            try:
                args = json.loads(bytes(self._args).decode("utf-8") or "{}")
            except ValueError:
                args, error = None, "arguments are not JSON"
            if error is None and not isinstance(args, dict):
                error = "arguments are not a JSON object"
        if error is not None:
            message = f"call {pos + 1} ({name or '?'}): {error}"
            self._reply.errors.append(message)
            self._events.append(("tool_call_error", pos, message))
            return
        call = {"id": header if header.startswith("functions.") else f"functions.{name}:{pos}", "type": "function",
                "function": {"name": name, "arguments": json_compact(args)}}
        self._events.append(("tool_call", len(self._reply.tool_calls), call))
        self._reply.tool_calls.append(call)

    def _end(self, stopped: bool) -> None:
        self._flush_text()
        if self._mode in ("header", "arguments"):
            self._call_done(truncated=True)
        self._reply.complete = stopped
        self._mode = "done"

    def _take(self) -> list:
        out: list = []
        for e in self._events:
            if out and e[0] == "content" and out[-1][0] == "content":
                out[-1] = ("content", out[-1][1] + e[1])
            else:
                out.append(e)
        self._events = []
        return out
