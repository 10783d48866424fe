"""`k3 train` on inputs it cannot read: one line, `k3 train: error: ...`, exit 2, saying
what cannot be read. `--data` on an unreadable file was a 35-line PermissionError traceback (exit 1),
an unreadable data folder an "empty corpus"; `--resume` of an unreadable run folder or checkpoint a
traceback, or "no run.json" / a checkpoint without its files. The tests run as root, which reads
anything, so `deny` (tests/checkpoint/test_unreadable_checkpoint.py's `denier`) makes a path
unreadable the way chmod 000 does for anyone else."""
from __future__ import annotations

import argparse

import pytest

from k3.data.corpus import DataError, load_documents
from k3.train import cli as train_cli
from k3.train.trainer import Trainer
from tests.checkpoint.test_unreadable_checkpoint import denier
from tests.helpers.train import quiet, tiny_settings

TEXT = "\n\n".join(f"Paragraph {i} of a corpus, long enough to be cut into pieces." for i in range(40))


@pytest.fixture
def deny(monkeypatch):
    return denier(monkeypatch)


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    return train_cli.run(parser.parse_args(argv))


def one_line_error(capsys, *expected: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith("k3 train: error:") and err.count("\n") == 1, err
    assert "Traceback" not in err and all(e in err for e in expected), err
    return err


def test_an_unreadable_data_file_is_a_data_error(tmp_path, deny):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    assert len(load_documents(corpus)) > 2
    deny(corpus)
    with pytest.raises(DataError, match="corpus.txt: cannot read \\(Permission denied\\)"):
        load_documents(corpus)


def test_an_unreadable_data_folder_is_not_an_empty_corpus(tmp_path, deny):
    (tmp_path / "data" / "sub").mkdir(parents=True)
    (tmp_path / "data" / "a.txt").write_text(TEXT)
    (tmp_path / "data" / "sub" / "b.txt").write_text(TEXT)
    assert len(load_documents(tmp_path / "data")) == 2
    deny(tmp_path / "data" / "sub")  # a folder inside: its files are not silently left out
    with pytest.raises(DataError, match="sub: cannot read \\(Permission denied\\)"):
        load_documents(tmp_path / "data")
    deny(tmp_path / "data")
    with pytest.raises(DataError, match="data: cannot read"):
        load_documents(tmp_path / "data")


@pytest.mark.parametrize("what", ["file", "folder"])
def test_k3_train_on_unreadable_data_is_one_line(tmp_path, deny, capsys, what):
    data = tmp_path / "data"
    data.mkdir()
    (data / "corpus.txt").write_text(TEXT)
    deny(data / "corpus.txt" if what == "file" else data)
    path = data / "corpus.txt" if what == "file" else data
    out = tmp_path / "run"
    assert cli(["--data", str(path), "--out", str(out), "--cache-dir", str(tmp_path / "cache"), "--no-progress"]) == 2
    one_line_error(capsys, f"{path}: cannot read (Permission denied)")
    assert not out.exists()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A two-step run with one checkpoint, step 2."""
    root = tmp_path_factory.mktemp("unreadable")
    settings = tiny_settings(root, "run", steps=2, ckpt_every=2, eval_every=2, eval_windows=1)
    Trainer(settings, progress=False, log=quiet).train()
    return root / "run"


@pytest.mark.parametrize("denied", ["run", "checkpoints", "checkpoint"])
def test_resume_of_an_unreadable_run_or_checkpoint_is_one_line(finished_run, deny, capsys, denied):
    path = {"run": finished_run, "checkpoints": finished_run / "checkpoints",
            "checkpoint": finished_run / "checkpoints" / "step_0000002"}[denied]
    deny(path)
    assert cli(["--resume", str(finished_run)]) == 2
    one_line_error(capsys, f"{path} is unreadable (Permission denied)")
