"""The settings the training verbs share are declared once (k3/train/settings.py): no field has two
declarations, each verb keeps its own defaults through its DEFAULTS table, every verb's parser has
the shared flags (with that verb's defaults in the help), and run.json files of the earlier layout
still load."""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
from collections import Counter, defaultdict

import pytest

from k3.rl import cli as rl_cli
from k3.rl import distill_cli
from k3.rl.distill import DistillSettings, DistillTrainer
from k3.rl.trainer import RLSettings, RLTrainer, RolloutSettings
from k3.sft import cli as sft_cli
from k3.sft.trainer import SFTSettings, SFTTrainer
from k3.train import cli as train_cli
from k3.train import settings as shared
from k3.train.settings import RunSettings, StartSettings, declared_in, option, sections, settings
from k3.train.trainer import Trainer, TrainSettings
from k3.train.vl_trainer import VLSettings, VLTrainer

ALL = (TrainSettings, VLSettings, SFTSettings, RolloutSettings, RLSettings, DistillSettings)
VERBS = {"train": (train_cli, TrainSettings), "sft": (sft_cli, SFTSettings), "rl": (rl_cli, RLSettings),
         "distill": (distill_cli, DistillSettings)}
# each verb's values of the fields where verbs differ, as they were before the sections existed
OWN_DEFAULTS = {
    TrainSettings: {"steps": 250, "batch_size": 8, "seq_len": 256, "lr": 4e-3, "min_lr_ratio": 0.1,
                    "weight_decay": 0.1, "eval_every": 100, "ckpt_every": 100, "keep": 3, "val_fraction": 0.02,
                    "config": "k3-tiny", "eval_windows": None},
    VLSettings: {"steps": 560, "batch_size": 2, "seq_len": 160, "lr": 4e-3, "min_lr_ratio": 0.1, "weight_decay": 0.1,
                 "eval_every": 280, "ckpt_every": 100, "keep": 3, "val_fraction": 0.02, "config": "k3-tiny-vl",
                 "eval_windows": 16},
    SFTSettings: {"steps": 100, "batch_size": 8, "seq_len": 1024, "lr": 2e-3, "min_lr_ratio": 0.1,
                  "weight_decay": 0.0, "eval_every": 50, "ckpt_every": 20, "keep": 2, "val_fraction": 0.05, "init": ""},
    RLSettings: {"steps": 40, "lr": 1e-4, "min_lr_ratio": 1.0, "weight_decay": 0.0, "eval_every": 10,
                 "ckpt_every": 10, "keep": 2, "prompts": 8, "samples": 8, "pool": 128, "init": ""},
    DistillSettings: {"steps": 40, "lr": 1e-4, "min_lr_ratio": 1.0, "weight_decay": 0.0, "eval_every": 10,
                      "ckpt_every": 10, "keep": 2, "prompts": 2, "samples": 4, "pool": 128, "init": ""},
}
COMMON = {"out": None, "seed": 0, "device": "cpu", "cache_dir": None, "grad_clip": 1.0, "optimizer": "per-head-muon",
          "balance": "quantile", "qat": False, "compile": False, "keep_all_state": False}


def test_every_settings_field_is_declared_once():
    owners = defaultdict(set)
    for cls in ALL:
        for f in dataclasses.fields(cls):
            owners[f.name].add(declared_in(cls, f.name))
    twice = {name: sorted(k.__qualname__ for k in found) for name, found in owners.items() if len(found) > 1}
    assert not twice, f"fields declared in more than one settings class: {twice}"


def test_fields_the_verbs_share_are_declared_in_the_sections():
    counts = Counter(f.name for cls in (TrainSettings, SFTSettings, RolloutSettings) for f in dataclasses.fields(cls))
    shared_names = {name for name, n in counts.items() if n > 1}
    assert {"steps", "batch_size", "seq_len", "grad_accum", "lr", "min_lr_ratio", "weight_decay", "grad_clip",
            "optimizer", "balance", "qat", "compile", "seed", "device", "out", "keep", "keep_all_state", "ckpt_every",
            "eval_every", "cache_dir", "data", "val_fraction", "init"} <= shared_names
    for cls in ALL:
        for name in shared_names & {f.name for f in dataclasses.fields(cls)}:
            assert declared_in(cls, name).__module__ == shared.__name__, (cls.__name__, name)
    # the sections are what the verbs have in common, nothing else
    section_fields = {f.name for k in vars(shared).values() if isinstance(k, type) and "TITLE" in vars(k)
                      for f in dataclasses.fields(k)}
    assert section_fields == shared_names


@pytest.mark.parametrize("cls", list(OWN_DEFAULTS), ids=lambda c: c.__name__)
def test_each_verb_keeps_its_defaults(cls):
    expected = {**COMMON, **OWN_DEFAULTS[cls]}
    made, fields = cls(), {f.name: f for f in dataclasses.fields(cls)}
    signature = inspect.signature(cls).parameters
    for name, value in expected.items():
        assert getattr(made, name) == value, name
        assert fields[name].default == value and signature[name].default == value, name  # what introspection sees
    assert cls(steps=3).steps == 3 and dataclasses.replace(made, lr=0.5).lr == 0.5
    assert cls(**dataclasses.asdict(made)) == made


def test_a_verbs_defaults_leave_the_sections_and_other_verbs_alone():
    assert RunSettings.__dataclass_fields__["steps"].default is dataclasses.MISSING
    assert TrainSettings.__dataclass_fields__["steps"].default == 250 and VLSettings.steps == 560
    assert RolloutSettings().prompts == RLSettings().prompts == 8 and DistillSettings().prompts == 2
    with pytest.raises(TypeError):
        TrainSettings(1)  # keyword-only: a positional value cannot collide with a verb's default


def test_the_defaults_table_names_inherited_fields_only():
    with pytest.raises(TypeError, match="no field it inherits"):
        @settings
        class Twice(RunSettings):
            DEFAULTS = {"steps": 3}  # noqa: RUF012
            steps: int = 5

    with pytest.raises(TypeError, match="no field it inherits"):
        @settings
        class Unknown(RunSettings):
            DEFAULTS = {"stepz": 3}  # noqa: RUF012

    with pytest.raises(TypeError, match="HELP names no field"):
        @settings
        class BadHelp(RunSettings):
            DEFAULTS = {"steps": 3, "eval_every": 1}  # noqa: RUF012
            HELP = {"stepz": "?"}  # noqa: RUF012

    @settings
    class Made(RunSettings):
        DEFAULTS = {"steps": 3, "eval_every": 1}  # noqa: RUF012
        HELP = {"steps": "rounds"}  # noqa: RUF012
        rounds: int = option(2, "extra")

    assert (Made().steps, Made(steps=4).steps, Made().rounds) == (3, 4, 2)


def _parser(verb: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"k3 {verb}", allow_abbrev=False)
    VERBS[verb][0].add_arguments(p)
    return p


@pytest.mark.parametrize("verb", list(VERBS))
def test_every_verb_has_the_shared_flags_with_its_own_defaults(verb):
    p, cls = _parser(verb), VERBS[verb][1]
    made = cls()
    actions = {o: a for a in p._actions for o in a.option_strings}
    flags = 0
    for section in sections(cls):
        for f in dataclasses.fields(cls):
            if declared_in(cls, f.name) is not section or "help" not in f.metadata or section is StartSettings:
                continue  # StartSettings' init: --run / --model, below
            flag = "--" + f.name.replace("_", "-")
            flag = "--no-" + flag[2:] if getattr(made, f.name) is True else flag
            action = actions[flag]
            assert action.dest == f.name and action.default is None, flag  # left out: the settings' default
            value = getattr(made, f.name)
            if not isinstance(value, bool) and value not in (None, ""):
                assert f"default {value}" in action.help, (flag, action.help)
            flags += 1
    assert flags >= 16  # run 5, optimizer step 8, checkpoints 3, and more sections for most verbs
    assert {"--resume", "--no-progress"} <= set(actions)
    if StartSettings in cls.__mro__:  # --run, --model and --resume, one of them
        group = next(g for g in p._mutually_exclusive_groups if actions["--run"] in g._group_actions)
        assert {a.dest for a in group._group_actions} == {"init_run", "init_model", "resume"}
    else:
        assert "--run" not in actions and "--model" not in actions


def test_the_verb_wording_and_the_vl_defaults_show_in_help():
    train = {o: a.help for a in _parser("train")._actions for o in a.option_strings}
    assert train["--steps"] == "optimizer steps (default 250; VL configs: 560)"
    assert "default 100; VL configs: 280" in train["--eval-every"] and "VL configs" not in train["--lr"]
    rl = {o: a.help for a in _parser("rl")._actions for o in a.option_strings}
    assert rl["--steps"].startswith("iterations, one optimizer step each (default 40)")
    assert "(default 1.0: constant after warmup)" in rl["--min-lr-ratio"]
    distill = {o: a.help for a in _parser("distill")._actions for o in a.option_strings}
    assert distill["--pool"] == "training prompts per teacher, cycled (default 128)"
    assert "(default 2)" in distill["--prompts"]


def test_flags_reach_the_settings():
    args = _parser("train").parse_args(["--lr", "0.5", "--min-lr-ratio", "0", "--keep", "1", "--qat",
                                        "--val-fraction", "0.1", "--set", "num_hidden_layers=4"])
    s = train_cli._settings(args)
    assert (s.lr, s.min_lr_ratio, s.keep, s.qat, s.val_fraction, s.overrides) == (0.5, 0.0, 1, True, 0.1,
                                                                                  {"num_hidden_layers": 4})
    assert s.steps == 250 and train_cli._settings(args, VLSettings()).steps == 560
    s = sft_cli._settings(_parser("sft").parse_args(["--model", "ckpt", "--optimizer", "adamw", "--grad-accum", "2"]))
    assert (s.init, s.optimizer, s.grad_accum, s.keep) == ("ckpt", "adamw", 2, 2)
    args = _parser("rl").parse_args(["--run", "sft", "--no-share-prompts", "--pool", "5", "--domain", "strings"])
    s = rl_cli.settings_from(args, RLSettings(), RLSettings)
    assert (s.init, s.share_prompts, s.pool, s.domain, s.lr) == ("sft", False, 5, "strings", 1e-4)
    args = _parser("distill").parse_args(["--model", "m", "--teachers", "a", "b", "--samples", "3"])
    s = rl_cli.settings_from(args, DistillSettings(), DistillSettings)
    assert (s.init, s.teachers, s.samples, s.prompts) == ("m", ["a", "b"], 3, 2)


# run.json as the settings classes wrote it before the sections (field order and all)
OLD_RUNS = {
    "train": (Trainer, {
        "config": "k3-tiny", "overrides": {}, "data": None, "copy_share": 0.0, "weight_init": "zero-out",
        "out": "/nowhere/run", "steps": 6, "batch_size": 8, "seq_len": 256, "grad_accum": 1, "lr": 0.003,
        "min_lr_ratio": 0.1, "weight_decay": 0.1, "grad_clip": 1.0, "optimizer": "per-head-muon", "balance": "quantile",
        "qat": False, "compile": False, "val_fraction": 0.02, "eval_every": 100, "eval_windows": None,
        "sample_tokens": 80, "sample_prompts": ["To be, or not to be", "KING.\n"], "ckpt_every": 100, "keep": 3,
        "keep_all_state": False, "seed": 0, "device": "cpu", "ep": 1, "dp": None, "ep_plan": "balanced",
        "cache_dir": None}),
    "vl": (VLTrainer, {
        "config": "k3-tiny-vl", "overrides": {}, "data": None, "copy_share": 0.0, "weight_init": "zero-out",
        "out": "/nowhere/run", "steps": 5, "batch_size": 2, "seq_len": 160, "grad_accum": 1, "lr": 0.004,
        "min_lr_ratio": 0.1, "weight_decay": 0.1, "grad_clip": 1.0, "optimizer": "per-head-muon", "balance": "quantile",
        "qat": False, "compile": False, "val_fraction": 0.02, "eval_every": 280, "eval_windows": 16,
        "sample_tokens": 80, "sample_prompts": ["To be, or not to be", "KING.\n"], "ckpt_every": 100, "keep": 3,
        "keep_all_state": False, "seed": 0, "device": "cpu", "ep": 1, "dp": None, "ep_plan": "balanced",
        "cache_dir": None, "vl_scenes": 11, "vl_questions": 4, "vl_thinking": False, "image_size": 84,
        "vl_describe": False, "vl_loss_weight": 1.0, "vision_lr_scale": 1.0, "vision_optimizer": "", "vqa_eval": 400,
        "max_answer_tokens": 6, "baseline_examples": 2000}),
    "sft": (SFTTrainer, {  # before SFT chose an optimizer
        "init": "/nowhere/pre", "data": None, "val_data": None, "val_fraction": 0.05, "out": "/nowhere/sft",
        "train_size": 800, "val_size": 64, "steps": 4, "batch_size": 8, "seq_len": 1024, "grad_accum": 1, "lr": 0.002,
        "min_lr_ratio": 0.1, "weight_decay": 0.0, "grad_clip": 1.0, "balance": "quantile", "qat": False,
        "compile": False, "share_prefixes": True, "eval_every": 50, "agent_episodes": 64, "max_reply_tokens": 160,
        "ckpt_every": 20, "keep": 2, "keep_all_state": False, "seed": 0, "device": "cpu", "cache_dir": None}),
    "rl": (RLTrainer, {
        "init": "/nowhere/sft", "out": "/nowhere/rl", "steps": 4, "prompts": 8, "samples": 8, "stop_fraction": 1.0,
        "temperature": 1.0, "max_tokens": 160, "pool": 128, "heldout": 64, "eps_low": 0.2, "eps_high": 0.2,
        "lr": 0.0001, "min_lr_ratio": 1.0, "weight_decay": 0.0, "grad_clip": 1.0, "optimizer": "per-head-muon",
        "balance": "quantile", "qat": False, "batch_invariant": False, "share_prompts": True, "compile": False,
        "eval_every": 10, "ckpt_every": 10, "keep": 2, "keep_all_state": False, "seed": 0, "device": "cpu",
        "cache_dir": None, "domain": "arithmetic", "domain_options": {"max_level": 3}, "effort": "max", "tau": None,
        "budgets": None, "budget_samples": 4, "kl_coef": 0.0, "normalize_std": False, "filter_groups": False}),
    "distill": (DistillTrainer, {
        "init": "/nowhere/sft", "out": "/nowhere/d", "steps": 40, "prompts": 2, "samples": 4, "stop_fraction": 1.0,
        "temperature": 1.0, "max_tokens": 160, "pool": 128, "heldout": 64, "eps_low": 0.2, "eps_high": 0.2,
        "lr": 0.0001, "min_lr_ratio": 1.0, "weight_decay": 0.0, "grad_clip": 1.0, "optimizer": "per-head-muon",
        "balance": "quantile", "qat": False, "batch_invariant": False, "share_prompts": True, "compile": False,
        "eval_every": 10, "ckpt_every": 10, "keep": 2, "keep_all_state": False, "seed": 0, "device": "cpu",
        "cache_dir": None, "teachers": ["/nowhere/rl"]}),
}


@pytest.mark.parametrize("verb", list(OLD_RUNS))
def test_an_old_run_json_still_loads(verb, tmp_path):
    trainer_class, record = OLD_RUNS[verb]

    class Probe(trainer_class):  # from_run's reading of run.json, without building the run
        def __init__(self, settings, **kwargs):
            self.s, self.kwargs = settings, kwargs

    (tmp_path / "run.json").write_text(json.dumps(record, indent=2))
    loaded = Probe.from_run(tmp_path, progress=False)
    assert loaded.kwargs == {"resume": True, "progress": False}
    s = loaded.s
    assert type(s) is trainer_class.SETTINGS
    expected = {**record, "out": str(tmp_path)}
    if "sample_prompts" in expected:
        expected["sample_prompts"] = tuple(expected["sample_prompts"])
    assert {k: getattr(s, k) for k in expected} == expected
    assert s.optimizer == "per-head-muon"  # an SFT run.json from before the flag: the optimizer it ran with
    newer = {"optimizer", "sandboxes", "sandbox_memory_mb", "cuda_graphs", "precision"}  # fields added since, at their defaults
    assert {f.name for f in dataclasses.fields(s)} - set(record) <= newer
