"""What K3's XTML renderer and parser share: attribute escaping, compact JSON, argument types."""
from __future__ import annotations

import json

ARGUMENT_TYPES = ("string", "number", "boolean", "null", "object", "array")


def escape_attr(value) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def unescape_attr(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")  # this order keeps "&amp;quot;" literal


def json_compact(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
