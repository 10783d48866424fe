"""The model's tool calls, checked against the request's declared tools before a client sees them.

A call is returned in `tool_calls` only when it names a declared tool and its arguments are a JSON
object valid under that tool's `parameters` schema (jsonschema-rs). Anything else (an undeclared
tool, arguments that do not parse or fail the schema, a call the parser found malformed, a second
call when `parallel_tool_calls` is false) is left out and reported in the non-standard
`tool_call_errors` list beside it, so a client never executes a call the tool would reject and the
reason stays visible. Valid calls are numbered 0, 1, ... as streamed `delta.tool_calls[].index`.
Schemas compile with `k3/text/tool_schema.py` (no external `$ref`), as request validation did.
"""
from __future__ import annotations

import json

from k3.text.tool_schema import compile_parameters


class ToolCallChecker:
    def __init__(self, tools: list[dict], parallel: bool = True):
        self.parallel = parallel
        self.validators = {}
        for t in tools:
            fn = t["function"]
            self.validators[fn["name"]] = compile_parameters(fn.get("parameters"))
        self.calls: list[dict] = []  # accepted, in order
        self.errors: list[dict] = []

    def _problem(self, call: dict) -> str | None:
        name = call["function"]["name"]
        if name not in self.validators:
            return f"tool {name!r} is not among the request's tools"
        try:
            args = json.loads(call["function"]["arguments"])
        except json.JSONDecodeError as e:
            return f"arguments are not valid JSON ({e.msg})"
        if not isinstance(args, dict):
            return "arguments are not a JSON object"
        error = next(iter(self.validators[name].iter_errors(args)), None)
        if error is not None:
            return f"arguments do not match the tool's parameters: {str(error.message).splitlines()[0]}"
        if self.calls and not self.parallel:
            return "a second call while parallel_tool_calls is false"
        return None

    def add(self, call: dict) -> dict | None:
        """The call with its stream index when accepted, else None (recorded in `errors`)."""
        problem = self._problem(call)
        if problem is not None:
            self.errors.append({"name": call["function"]["name"], "arguments": call["function"]["arguments"],
                                "error": problem})
            return None
        accepted = {"index": len(self.calls), **call}
        self.calls.append(call)
        return accepted

    def malformed(self, message: str) -> dict:
        error = {"name": None, "arguments": None, "error": message}
        self.errors.append(error)
        return error
