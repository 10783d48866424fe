"""Reading JSONL with errors that name the line: the corpus reader and the SFT data reader share it."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} overflows a double")
    return value


def strict_loads(text: str):
    """json.loads as JSON has it: NaN, Infinity and numbers beyond a double are errors (ValueError;
    Python's json accepts them, and a model trained on them learns text no JSON parser reads)."""
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite)


def jsonl_records(path: str | Path, error: type[Exception], label: str | None = None,
                  opener=open) -> Iterator[tuple[int, object]]:
    """(1-based line, parsed value) for each non-blank line. A line that is not UTF-8 or not JSON
    raises `error("LABEL:LINE: why")` (lines are decoded one by one, so the number is exact)."""
    label = label or str(path)
    with opener(path, "rb") as f:
        for line, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise error(f"{label}:{line}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not text.strip():
                continue
            try:
                record = strict_loads(text)
            except json.JSONDecodeError as e:
                raise error(f"{label}:{line}: not valid JSON ({e.msg} at column {e.colno})") from None
            except ValueError as e:
                raise error(f"{label}:{line}: not valid JSON ({e})") from None
            except RecursionError:
                raise error(f"{label}:{line}: JSON nested too deeply") from None
            yield line, record
