"""`--optimizer per-head-muon|muon|adamw`: saved in run.json and resumed; a run.json written before
the switch existed resumes with K3's Per-Head Muon."""
from __future__ import annotations

import argparse
import json

import pytest

from k3.train import cli as train_cli
from k3.train.trainer import Trainer, TrainError
from tests.helpers.train import quiet, tiny_settings


def test_optimizer_is_saved_and_resumed(tmp_path):
    s = tiny_settings(tmp_path, "adamw", optimizer="adamw", steps=2, ckpt_every=1, eval_every=2)
    trainer = Trainer(s, progress=False, log=quiet)
    assert {g["kind"] for g in trainer.optimizer.param_groups} == {"adamw"}
    trainer.train()
    trainer.close()
    assert json.loads((tmp_path / "adamw" / "run.json").read_text())["optimizer"] == "adamw"
    resumed = Trainer.from_run(tmp_path / "adamw", progress=False, log=quiet)
    assert resumed.s.optimizer == "adamw" and {g["kind"] for g in resumed.optimizer.param_groups} == {"adamw"}
    resumed.close()


def test_run_file_without_optimizer_resumes_per_head_muon(tmp_path):
    s = tiny_settings(tmp_path, "old", steps=2, ckpt_every=1, eval_every=2)
    trainer = Trainer(s, progress=False, log=quiet)
    trainer.train()
    trainer.close()
    path = tmp_path / "old" / "run.json"
    raw = json.loads(path.read_text())
    del raw["optimizer"]
    path.write_text(json.dumps(raw))
    resumed = Trainer.from_run(tmp_path / "old", progress=False, log=quiet)
    assert resumed.s.optimizer == "per-head-muon"
    assert any(g["name"].startswith("muon_rows") for g in resumed.optimizer.param_groups)
    resumed.close()


def test_bad_optimizer_is_one_line(tmp_path):
    with pytest.raises(TrainError, match="optimizer must be one of per-head-muon, muon, adamw, got 'sgd'"):
        Trainer(tiny_settings(tmp_path, "bad", optimizer="sgd"), progress=False, log=quiet)
    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    assert parser.parse_args(["--optimizer", "muon"]).optimizer == "muon"
