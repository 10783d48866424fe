"""One chat completion's reply as the client sees it, built from the engine's token ids.

The XTML parser's events (k3/text/xtml_parser.py), each tool call checked against the request's
tools (k3/serve/api/tool_calls.py), and the request's stop strings matched on the content text
alone: never on the reasoning or on the format's tag names ("response", "call", ...), which are
text between the chat markers. It is the request stream's text view (`push` / `flush` /
`stopped`, k3/serve/engine.py `RequestStream`), so a stop string in the content ends generation
at once and frees the request's pages, as one does on /v1/completions.
"""
from __future__ import annotations

from k3.serve.api.tool_calls import ToolCallChecker
from k3.text.partial_match import StopStrings
from k3.text.xtml_parser import ReplyParser


class ChatReply:
    def __init__(self, parser: ReplyParser, checker: ToolCallChecker, stop: list[str] | None):
        self.parser, self.checker = parser, checker
        self._stops = StopStrings(stop)
        self._events: list[tuple] = []  # ("reasoning" | "content", text) or ("tool_call", accepted call)
        self.content, self.reasoning = "", ""

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    def push(self, token_ids: list[int]) -> str:
        if not self.stopped:
            self._take(self.parser.feed(token_ids))
        return ""  # the chat route reads `take()`, not the delta's text

    def flush(self) -> str:
        if not self.stopped:
            self._take(self.parser.finish())
            self._content(self._stops.flush())
        return ""

    def take(self) -> list[tuple]:
        """The events since the last call, in order."""
        out, self._events = self._events, []
        return out

    def _take(self, events: list[tuple]) -> None:
        for event in events:
            kind = event[0]
            if kind == "content":
                self._content(self._stops.push(event[1]))
                if self.stopped:
                    return  # the reply ends at the stop string
                continue
            self._content(self._stops.flush())  # content cannot go on past another element
            if kind == "tool_call":
                accepted = self.checker.add(event[2])
                if accepted is not None:
                    self._events.append(("tool_call", accepted))
            elif kind == "tool_call_error":
                self.checker.malformed(event[2])
            elif event[1]:
                self.reasoning += event[1]
                self._events.append(("reasoning", event[1]))

    def _content(self, text: str) -> None:
        if text:
            self.content += text
            self._events.append(("content", text))
