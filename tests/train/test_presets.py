"""The model presets live in k3/configs/ as config.json files loaded by name (text ones by
k3.config, vision-language ones by k3.train.vl_config), and pyproject ships exactly the data files
the package has."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3 import configs
from k3.config import PRESETS, K3Config, load_config
from k3.train.vl_config import VL_PRESETS, is_vl_config, load_vl_config

ROOT = Path(__file__).resolve().parents[2]


def test_every_file_is_a_preset_of_its_kind():
    files = sorted(p.stem for p in configs.FOLDER.glob("*.json"))
    assert sorted([*PRESETS, *VL_PRESETS]) == files
    assert {"k3", "k3-tiny", "k3-1b", "k3-slice"} <= set(PRESETS) and "k3-tiny-vl" in VL_PRESETS
    assert all(is_vl_config(name) for name in VL_PRESETS) and not any(is_vl_config(name) for name in PRESETS)
    assert configs.preset_file("../config") is None and configs.preset_file("") is None
    with pytest.raises(KeyError, match="presets: k3"):
        configs.read_preset("k3-huge")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_text_preset_is_its_file_written_out_whole(name):
    preset, path = load_config(name), configs.preset_file(name)
    assert preset == load_config(path) == K3Config.from_dict(json.loads(path.read_text()))
    assert preset.to_dict() == json.loads(path.read_text())
    # a model, not a file to echo: the wrapper's token ids follow the config's (a run's tokenizer sets them)
    moved = preset.replace(bos_token_id=7, eos_token_id=8, pad_token_id=9).to_dict()
    assert (moved["bos_token_id"], moved["text_config"]["bos_token_id"]) == (7, 7)


@pytest.mark.parametrize("name", sorted(VL_PRESETS))
def test_a_vl_preset_is_its_file(name):
    cfg, path = load_vl_config(name), configs.preset_file(name)
    assert cfg.to_dict() == json.loads(path.read_text())
    assert cfg.media_placeholder_token_id == cfg.text_config.vocab_size - 1
    smaller = load_vl_config(name, {"vocab_size": 512})
    assert smaller.media_placeholder_token_id == 511  # a preset's placeholder follows its vocabulary


def test_package_data_is_what_the_package_holds():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["k3"]
    k3 = ROOT / "k3"
    shipped = set()
    for pattern in patterns:
        found = {p for p in k3.glob(pattern) if p.is_file() and "__pycache__" not in p.parts}
        assert found, f"package-data pattern {pattern!r} matches nothing"
        shipped |= found
    data = {p for p in k3.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts}
    assert not data - shipped, f"data files the wheel would leave out: {sorted(str(p) for p in data - shipped)}"
