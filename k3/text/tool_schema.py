"""A tool's `parameters` JSON Schema, compiled with every `$ref` resolved inside the schema alone.

Tool declarations arrive from requests and SFT files. A reference to a file or URL would let a
request read the server's disk or reach its network (and block the event loop while it did), so
external references are refused, as are schemas that do not compile (unknown pointers, bad
regex patterns). The server checks a request's tools with it before generating (400, not a 500
after the reply); `k3 sft` checks a data file's tools with it (a one-line error naming the line).
"""
from __future__ import annotations

import jsonschema_rs


def _no_external_refs(uri: str):
    raise ValueError(f"external $ref {uri!r} is not allowed: references must point inside the schema")


def compile_parameters(schema: dict | None):
    """The validator of a tool's `parameters` (None: any object).

    Raises ValueError (a one-line reason) when the schema is not a valid JSON Schema, refers
    outside itself, or does not compile."""
    try:
        if schema is not None:
            jsonschema_rs.meta.validate(schema)
        return jsonschema_rs.validator_for(schema or {"type": "object"}, retriever=_no_external_refs)
    except (jsonschema_rs.ValidationError, ValueError) as e:
        raise ValueError(f"parameters is not a valid JSON Schema: {str(e).splitlines()[0]}") from None
