"""Run folders: a `k3 train` run keeps complete checkpoints as `checkpoints/step_{N:07d}/`; every
verb that takes a checkpoint also takes a run folder and reads its latest complete one."""
from __future__ import annotations

import re
from pathlib import Path

STEP_DIR = re.compile(r"^step_(\d{7})$")


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temp folders never match)."""
    if not ckpt_root.is_dir():
        return []
    return sorted(p for p in ckpt_root.iterdir() if p.is_dir() and STEP_DIR.match(p.name))


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    found = list_checkpoints(ckpt_root)
    return found[-1] if found else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder itself, or the latest complete checkpoint of a `k3 train` run folder."""
    path = Path(path)
    if (path / "config.json").is_file():
        return path
    found = latest_checkpoint(path / "checkpoints")
    if found is None:
        raise FileNotFoundError(f"{path} is neither a checkpoint folder nor a `k3 train` run with a complete "
                                "checkpoint")
    return found
