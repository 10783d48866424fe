"""What `k3 train` tells the user: plain progress lines without a usable terminal, honest advice
after Ctrl-C, one line for a failed checkpoint save, and a labelled loss plot."""
from __future__ import annotations

import argparse
import errno
import io

import pytest

from k3.train import cli as train_cli
from k3.train.metrics import loss_figure
from k3.train.progress import Progress, terminal_columns
from k3.train.trainer import Trainer
from tests.helpers.train import quiet, tiny_settings


class _FakeTerminal(io.StringIO):
    def __init__(self, columns: int):
        super().__init__()
        self.columns = columns

    def isatty(self) -> bool:
        return True

    def fileno(self) -> int:
        return 99


def _record(step):
    return {"loss": 5.0 - step / 10, "tok_per_s": 1800, "lr": 4e-3, "elapsed": float(step)}


@pytest.mark.parametrize("columns", [0, 10], ids=["zero-columns", "too-narrow"])
def test_progress_degrades_to_plain_lines(monkeypatch, columns):
    monkeypatch.setattr("os.get_terminal_size", lambda fd: __import__("os").terminal_size((columns, 24)))
    monkeypatch.delenv("COLUMNS", raising=False)
    stream, lines = _FakeTerminal(columns), []
    assert terminal_columns(stream) == columns
    progress = Progress(10, 0, stream=stream, log=lambda line, **_: lines.append(line), every=4)
    for step in range(1, 11):
        progress.update(step, _record(step))
    progress.write("step 10: val loss 4.0")
    progress.close()
    assert stream.getvalue() == ""  # no bar drawn
    assert [line.split(":")[0] for line in lines] == ["step 4/10", "step 8/10", "step 10/10", "step 10"]
    assert lines[0] == "step 4/10: loss 4.6000, 1,800 tok/s, lr 4.00e-03, 4 s"


def test_progress_bar_on_a_real_width(monkeypatch):
    monkeypatch.setattr("os.get_terminal_size", lambda fd: __import__("os").terminal_size((100, 24)))
    stream, lines = _FakeTerminal(100), []
    progress = Progress(3, 0, stream=stream, log=lambda line, **_: lines.append(line))
    progress.update(1, _record(1))
    progress.close()
    assert progress.bar is not None and "train" in stream.getvalue() and not lines


def test_not_a_terminal_has_no_width():
    assert terminal_columns(io.StringIO()) == 0


def _cli(argv):
    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    return train_cli.run(parser.parse_args(argv))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One tokenizer/token cache for the module: the tokenizer is trained once."""
    return str(tmp_path_factory.mktemp("cache"))


def _argv(settings, cache_dir, **changes):
    argv = ["--config", settings.config, "--data", settings.data, "--out", settings.out, "--steps", "3",
            "--batch-size", "4", "--seq-len", "32", "--eval-every", "10", "--eval-windows", "1",
            "--cache-dir", cache_dir, "--no-progress"]
    for flag, value in changes.items():
        argv += [f"--{flag.replace('_', '-')}", str(value)]
    return argv


def test_interrupt_before_the_first_checkpoint_says_nothing_to_resume(tmp_path, capsys, monkeypatch, cache_dir):
    settings = tiny_settings(tmp_path, "run")

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "train", interrupted)
    assert _cli(_argv(settings, cache_dir)) == 130
    err = capsys.readouterr().err
    assert "nothing to resume" in err and "--resume" not in err


def test_interrupt_after_a_checkpoint_names_its_step(tmp_path, capsys, monkeypatch, cache_dir):
    settings = tiny_settings(tmp_path, "run")
    real_step = Trainer.train_step

    def step_then_stop(self):
        if self.step == 2:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(Trainer, "train_step", step_then_stop)
    assert _cli(_argv(settings, cache_dir, ckpt_every=1)) == 130
    err = capsys.readouterr().err
    assert f"continue from step 2 with: k3 train --resume {settings.out}" in err
    resumed = Trainer.from_run(settings.out, progress=False, log=quiet)
    assert resumed.step == 2
    resumed.close()


def test_full_disk_during_a_save_is_one_line(tmp_path, capsys, monkeypatch, cache_dir):
    from k3.checkpoint import training_state

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(training_state, "save_file", no_space)
    settings = tiny_settings(tmp_path, "run")
    assert _cli(_argv(settings, cache_dir, ckpt_every=2)) == 1
    err = capsys.readouterr().err
    assert err == f"k3 train: error: cannot save checkpoint {settings.out}/checkpoints/step_0000002: " \
                  "No space left on device\n"
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == []


def test_loss_plot_has_a_title_and_labelled_series():
    records = [{"kind": "train", "step": s, "loss": 5.0 - s / 100} for s in range(1, 301)]
    records += [{"kind": "eval", "step": s, "val_loss": 4.5, "val_tokens": 45_602} for s in (100, 200, 300)]
    records += [{"kind": "eval", "step": 50, "val_loss": 4.9, "val_tokens": 4_096}]  # an older, partial eval
    fig = loss_figure(records, title="tiny run")
    ax = fig.axes[0]
    assert ax.get_title() == "tiny run"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "train loss (batch)", "val loss (4,096 held-out tokens)", "val loss (45,602 held-out tokens)"]
