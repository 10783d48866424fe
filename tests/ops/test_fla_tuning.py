"""Recorded fla autotuning (k3/ops/fla_tuning.py): what is recorded is seeded back exactly, and
seeding never changes what a kernel computes — only configs the installed fla offers are used,
and keys already tuned in the process stay. Fake autotuners stand in for Triton's (no triton on
CPU machines); the GPU tests run the real ones."""
from __future__ import annotations

import json
import sys
import types

import pytest

from k3.ops import fla_tuning


class Config:  # the attributes of triton.Config that a record keeps
    def __init__(self, kwargs, num_warps=4, num_stages=2):
        self.kwargs, self.num_warps, self.num_stages, self.num_ctas, self.maxnreg = kwargs, num_warps, num_stages, 1, None


def kernel_fn(name):
    def fn():
        pass
    fn.__name__, fn.__module__ = name, "fla.fake_ops"
    return fn


class Autotuner:
    def __init__(self, name, configs):
        self.configs, self.cache, self.base_fn, self.fn = configs, {}, kernel_fn(name), None


class Heuristics:  # triton.heuristics wrapping an autotuner, as fla stacks them
    def __init__(self, fn):
        self.fn = fn


@pytest.fixture
def fake_fla(monkeypatch):
    a = Autotuner("kernel_a", [Config({"BT": 32}), Config({"BT": 64}, num_warps=8)])
    b = Autotuner("kernel_b", [Config({"BV": 16}), Config({"BV": 32})])
    module = types.ModuleType("fla.fake_ops")
    module.kernel_a, module.kernel_b = a, Heuristics(b)
    monkeypatch.setitem(sys.modules, "fla.fake_ops", module)
    return a, b


def test_recorded_choices_seed_back_to_the_offered_configs(fake_fla, tmp_path):
    a, b = fake_fla
    a.cache[(4, 32, "torch.bfloat16")] = a.configs[1]
    b.cache[(4, False)] = b.configs[0]
    path = tmp_path / "tuning.json"
    assert fla_tuning.record(path) == 2
    a.cache.clear()
    b.cache.clear()
    assert fla_tuning.seed(path, force=True) == 2
    assert a.cache == {(4, 32, "torch.bfloat16"): a.configs[1]}  # the very object fla offers
    assert b.cache[(4, False)] is b.configs[0]


def test_seeding_skips_configs_fla_no_longer_offers_and_keeps_tuned_keys(fake_fla, tmp_path):
    a, b = fake_fla
    record = {"fla.fake_ops.kernel_a": [[[1], {"kwargs": {"BT": 128}, "num_warps": 4, "num_stages": 2,
                                               "num_ctas": 1, "maxnreg": None}],
                                        [[2], {"kwargs": {"BT": 32}, "num_warps": 4, "num_stages": 2,
                                               "num_ctas": 1, "maxnreg": None}]],
              "fla.fake_ops.kernel_b": [[[3], {"kwargs": {"BV": 16}, "num_warps": 4, "num_stages": 2,
                                               "num_ctas": 1, "maxnreg": None}]]}
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps(record))
    b.cache[(3,)] = b.configs[1]  # tuned in this process already: a record never overrides it
    assert fla_tuning.seed(path, force=True) == 1
    assert (1,) not in a.cache and a.cache[(2,)] is a.configs[0]
    assert b.cache[(3,)] is b.configs[1]


def test_seeding_applies_only_on_hopper_and_can_be_turned_off(fake_fla, monkeypatch):
    monkeypatch.setenv(fla_tuning.DISABLE_ENV, "1")
    assert fla_tuning.seed() == 0
    monkeypatch.delenv(fla_tuning.DISABLE_ENV)
    assert fla_tuning.seed() == 0  # no CUDA here
    assert fla_tuning.seed("/nonexistent.json", force=True) == 0


def test_shipped_record_is_well_formed():
    table = json.loads(fla_tuning.TUNING_FILE.read_text())
    assert table and all(name.startswith("fla.") for name in table)
    for entries in table.values():
        for key, config in entries:
            assert isinstance(key, list) and set(config) == {"kwargs", "num_warps", "num_stages", "num_ctas", "maxnreg"}
