"""A checkpoint or run folder that is there but cannot be read is reported as unreadable, never as
missing: Path.is_file inside such a folder answers False on Python >= 3.13 (so a run read
as "no checkpoint", a checkpoint as one without its files) and raises PermissionError before that (a
traceback). The tests run as root, which reads anything, so `deny` makes a path unreadable the way
chmod 000 does for anyone else."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from k3.checkpoint.run_folder import (
    CheckpointUnreadableError,
    check_readable,
    latest_checkpoint,
    pin,
    resolve_checkpoint,
)


def permission_denied(path) -> PermissionError:
    return PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))


def denier(monkeypatch):
    """A function deny(path) after which listing `path` (a folder) or reading it (a file) raises
    PermissionError, until the test ends."""
    denied: set[Path] = set()

    def guarded(real):
        def call(path=".", *args, **kwargs):
            if isinstance(path, (str, os.PathLike)) and Path(path) in denied:
                raise permission_denied(path)
            return real(path, *args, **kwargs)
        return call

    monkeypatch.setattr(os, "listdir", guarded(os.listdir))
    monkeypatch.setattr(os, "scandir", guarded(os.scandir))
    monkeypatch.setattr(Path, "read_text", guarded(Path.read_text))
    return lambda path: denied.add(Path(path))


@pytest.fixture
def deny(monkeypatch):
    return denier(monkeypatch)


def run_folder(root: Path, steps=(2, 4)) -> Path:
    for step in steps:
        folder = root / "run" / "checkpoints" / f"step_{step:07d}"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
    return root / "run"


def test_an_unreadable_checkpoint_is_not_a_missing_one(tmp_path, deny):
    run = run_folder(tmp_path)
    latest = run / "checkpoints" / "step_0000004"
    assert resolve_checkpoint(run) == latest == resolve_checkpoint(latest)
    deny(latest)
    for path in (run, latest):
        with pytest.raises(CheckpointUnreadableError, match=f"{latest} is unreadable \\(Permission denied\\)"):
            resolve_checkpoint(path)
    with pytest.raises(CheckpointUnreadableError, match="step_0000004 is unreadable"):
        latest_checkpoint(run / "checkpoints")
    with pytest.raises(CheckpointUnreadableError, match="step_0000004 is unreadable"):
        pin({"reference": str(latest)}, "reference", run)  # a pinned checkpoint is not "gone" either
    assert issubclass(CheckpointUnreadableError, ValueError)  # the CLIs that print a ValueError in one line


def test_an_unreadable_run_folder_is_not_one_without_checkpoints(tmp_path, deny):
    run = run_folder(tmp_path)
    deny(run / "checkpoints")
    with pytest.raises(CheckpointUnreadableError, match="checkpoints is unreadable"):
        latest_checkpoint(run / "checkpoints")
    deny(run)
    with pytest.raises(CheckpointUnreadableError, match=f"{run} is unreadable"):
        resolve_checkpoint(run)


def test_a_folder_listed_but_not_entered_is_unreadable(tmp_path, monkeypatch):
    """Read permission without search permission: the names list, but nothing in it can be opened."""
    folder = run_folder(tmp_path) / "checkpoints" / "step_0000004"
    real_stat = os.stat

    def stat(path, *args, **kwargs):
        if str(path) == os.path.join(folder, "."):  # looking anything up inside it
            raise permission_denied(path)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    with pytest.raises(CheckpointUnreadableError, match="step_0000004 is unreadable"):
        check_readable(folder)


def test_missing_stays_missing(tmp_path):
    check_readable(tmp_path / "nothing")  # nothing there is the caller's to report
    assert latest_checkpoint(tmp_path / "nothing" / "checkpoints") is None
    with pytest.raises(FileNotFoundError, match="neither a checkpoint folder nor"):
        resolve_checkpoint(tmp_path / "nothing")
    (tmp_path / "a-file").write_text("x")
    check_readable(tmp_path / "a-file")
