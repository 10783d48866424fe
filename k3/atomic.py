"""Atomic file writes: a temp file beside the target, then one rename over it (atomic on POSIX),
so a reader, or a run resumed after a kill, never sees a half-written file.

The temp name carries the process id (ranks of one torchrun job may fill one cache at once) and
keeps the target's suffix (numpy and matplotlib choose the format from it).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def write_atomic(path: str | Path, write: Callable[[Path], object]) -> Path:
    """`write(tmp)` writes the whole file at `tmp`; it then replaces `path` in one step."""
    path = Path(path)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_atomic(path, lambda tmp: tmp.write_text(text))
