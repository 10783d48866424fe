"""Run folders: a `k3 train` run keeps complete checkpoints as `checkpoints/step_{N:07d}/`; every
verb that takes a checkpoint also takes a run folder and reads its latest complete one. A folder
that is there but cannot be read (permissions) is reported as unreadable, never as missing."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from k3.atomic import write_text_atomic

STEP_DIR = re.compile(r"^step_(\d{7})$")


class CheckpointUnreadableError(ValueError):
    """A checkpoint or run folder that is there but cannot be read: not a missing one."""


def check_readable(folder: str | Path) -> None:
    """CheckpointUnreadableError where `folder` exists but cannot be listed or entered: Path.is_file
    and is_dir on what is inside would call it missing (Python >= 3.13) or raise PermissionError."""
    try:
        os.listdir(folder)
        os.stat(os.path.join(folder, "."))  # entering it needs search permission, listing it does not
    except (FileNotFoundError, NotADirectoryError):
        return  # nothing there (or a file): the caller says what is missing
    except OSError as e:
        raise CheckpointUnreadableError(f"{folder} is unreadable ({e.strerror or e})") from None


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temp folders never match)."""
    check_readable(ckpt_root)
    if not ckpt_root.is_dir():
        return []
    return sorted(p for p in ckpt_root.iterdir() if p.is_dir() and STEP_DIR.match(p.name))


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    found = list_checkpoints(ckpt_root)
    if found:
        check_readable(found[-1])  # its files would read as missing
    return found[-1] if found else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder itself, or the latest complete checkpoint of a `k3 train` run folder."""
    path = Path(path)
    check_readable(path)
    if (path / "config.json").is_file():
        return path
    found = latest_checkpoint(path / "checkpoints")
    if found is None:
        raise FileNotFoundError(f"{path} is neither a checkpoint folder nor a `k3 train` run with a complete "
                                "checkpoint")
    return found


# the checkpoints a run reads besides its own (the RL KL reference, MOPD's teachers), pinned when it
# starts: a run folder's latest checkpoint moves if that run goes on, and an exact resume must not
PINS_FILE = "sources.json"


def read_pins(run_dir: Path) -> dict[str, str]:
    """The checkpoints `run_dir` pinned at its start ({} for a run from before pinning)."""
    path = Path(run_dir) / PINS_FILE
    if not path.is_file():
        return {}
    try:
        pins = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is damaged: {e}") from None
    if not isinstance(pins, dict) or not all(isinstance(v, str) for v in pins.values()):
        raise ValueError(f"{path} is damaged: expected an object of checkpoint paths")
    return pins


def pin(pins: dict[str, str], key: str, source: str | Path) -> Path:
    """The checkpoint pinned under `key`, else `source` resolved (and pinned in `pins`)."""
    if key in pins:
        path = Path(pins[key])
        check_readable(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"the {key} checkpoint this run started from, {path}, is gone "
                                    "(its run pruned it?): resuming would read other weights")
        return path
    path = resolve_checkpoint(source).resolve()
    pins[key] = str(path)
    return path


def write_pins(run_dir: Path, pins: dict[str, str]) -> None:
    write_text_atomic(Path(run_dir) / PINS_FILE, json.dumps(pins, indent=2) + "\n")
