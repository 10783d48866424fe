"""Reading JSONL with errors that name the line: the corpus reader and the SFT data reader share it."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


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
                record = json.loads(text)
            except json.JSONDecodeError as e:
                raise error(f"{label}:{line}: not valid JSON ({e.msg} at column {e.colno})") from None
            except RecursionError:
                raise error(f"{label}:{line}: JSON nested too deeply") from None
            yield line, record
