"""Resuming a stream on another replica: what the client was sent, and skipping it in the replay.

When a replica fails mid-stream, the router sends the same request (same seed: it adds one to a
sampled request that has none) to the next replica and passes on only what comes after the text
already sent, with the first stream's id. Greedy and seeded decoding replay the same reply, so the
client sees one uninterrupted stream. If the replay differs from what was sent (a near-tie decided
the other way under a different batch), the stream cannot go on consistently: `Diverged`, and the
client gets the documented error chunk (docs/ROUTING.md).
"""
from __future__ import annotations

import json

TEXT_FIELDS = ("text", "content", "reasoning")  # completion text; chat content and reasoning


class Diverged(Exception):
    """The replayed reply differs from what the client was already sent."""


class Transcript:
    def __init__(self):
        self.sent = dict.fromkeys(TEXT_FIELDS, "")
        self.calls: list = []  # tool calls sent (their `function` parts)
        self.role_sent = False
        self.ident: tuple | None = None  # the first stream's (id, created)
        self.skip: dict[str, str] | None = None  # while replaying: text still to skip, per field
        self.skip_calls: list = []
        self.resumed = False

    def restart(self) -> None:
        """A new replica replays the request from the start."""
        self.skip, self.skip_calls, self.resumed = dict(self.sent), list(self.calls), True

    def pass_on(self, data: str) -> str | None:
        """The SSE payload to send the client for `data` from the replica (None: nothing to send)."""
        try:
            event = json.loads(data)
        except ValueError:
            return data
        if not isinstance(event, dict) or "error" in event:
            return data
        if self.ident is None:
            self.ident = (event.get("id"), event.get("created"))
        if not self.resumed:
            self._record(event)
            return data
        event["id"], event["created"] = self.ident
        choices = event.get("choices") or []
        if choices and not self._trim(choices[0]):
            return None
        self._record(event)
        return json.dumps(event)

    def _part(self, choice: dict) -> dict:
        return choice["delta"] if isinstance(choice.get("delta"), dict) else choice

    def _record(self, event: dict) -> None:
        for choice in event.get("choices") or []:
            part = self._part(choice)
            for field in TEXT_FIELDS:
                if isinstance(part.get(field), str):
                    self.sent[field] += part[field]
            self.calls += [c.get("function") for c in part.get("tool_calls") or () if isinstance(c, dict)]
            self.role_sent |= "role" in part

    def _trim(self, choice: dict) -> bool:
        """Drop from a replayed choice what was sent already; False when nothing is left of it."""
        part, trimmed = self._part(choice), False
        if "role" in part and self.role_sent:
            del part["role"]
            if part.get("content") == "":
                del part["content"]
        for field in TEXT_FIELDS:
            value, skip = part.get(field), self.skip.get(field, "")
            if not isinstance(value, str) or not skip:
                continue
            if skip.startswith(value):
                self.skip[field] = skip[len(value):]
                new = None
            elif value.startswith(skip):
                self.skip[field], new = "", value[len(skip):]
            else:
                raise Diverged(f"the replay's {field} differs from the text already sent")
            trimmed = True
            for name in (field, "reasoning_content") if field == "reasoning" else (field,):
                if new:
                    part[name] = new
                else:
                    part.pop(name, None)
        calls = part.get("tool_calls")
        if isinstance(calls, list) and self.skip_calls:
            kept = []
            for call in calls:
                if self.skip_calls and isinstance(call, dict):
                    if call.get("function") != self.skip_calls.pop(0):
                        raise Diverged("the replay's tool call differs from the one already sent")
                    trimmed = True
                else:
                    kept.append(call)
            if kept:
                part["tool_calls"] = kept
            else:
                del part["tool_calls"]
        if choice.get("finish_reason") and (any(self.skip.values()) or self.skip_calls):
            raise Diverged("the replay ended before the text already sent")
        if trimmed:
            choice["logprobs"] = None  # the skipped tokens' logprobs went with the first stream
        meaningful = any(v not in (None, "", [], {}) for k, v in part.items() if k != "index")
        kept_as_is = not trimmed and (part is choice or choice.get("logprobs") is not None)
        return meaningful or bool(choice.get("finish_reason")) or kept_as_is
